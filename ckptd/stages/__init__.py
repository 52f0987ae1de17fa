"""Pipeline stages (`validate`, `compress`, `upload`): each idempotent, given plain paths,
options and a backend; none touches the store, and none of the three imports another (the
import contract "Stages are independent of each other"). Their helpers live in sub-packages:
`deep` (the deep checks validation runs), `sending` (an object file as a put's source, the
upload ledger, objects sent early while validation goes on: the compress stage's early sends
use them too) and `multinode` (a multi-node root's upload, and the commit records it needs).
Retention's deletes live in `ckptd.retention`."""
