"""Pipeline stages (validate, compress, upload, prune): each idempotent, given plain paths and
options; none touches the store or imports another stage."""
