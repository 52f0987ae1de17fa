"""Pipeline stages: validate, compress and upload (`validate`, `compress`, `upload`), each
idempotent, given plain paths, options and a backend; none touches the store or imports another
stage. Their helpers live in sub-packages: `checks` (validation's deep and non-finite checks),
`sending` (an object file as a put's source, the upload ledger, objects sent early) and
`multinode` (one node's share of a multi-node step, and the commit records it reads).
Retention's deletes live in `ckptd.retention`."""
