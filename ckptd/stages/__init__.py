"""Pipeline stages (`validate`, `compress`, `upload`): each idempotent, given plain paths and
options; none touches the store, and none of the three imports another (the import contract
"Stages are independent of each other"). Their own parts: the deep checks validation runs
(`deepscan`, `nonfinite`), objects sent early while validation goes on (`early`), the local side
of an upload (`upload_local`: the compress stage's early sends use it too), a multi-node root's
upload (`parts`) and the commit records its commit needs (`records`). Retention's deletes live
in `ckptd.retention`."""
