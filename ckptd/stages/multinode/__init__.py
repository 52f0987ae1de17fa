"""The upload stage of a multi-node root: one node's share of a step, written as a part and
committed by the coordinator (`parts`), and each layout's commit record read from the local
files (`records`). Decisions are `ckptd.cluster`'s; never imports the store."""
