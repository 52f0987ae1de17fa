"""Pipeline stages (validate, compress, upload): each idempotent, given plain paths and options;
none touches the store or imports another stage. Retention's deletes live in `ckptd.retention`."""
