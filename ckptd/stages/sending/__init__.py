"""What sends a step's objects, for the upload stage and for the early sender the compress
stage's Stager feeds while validation reads: an object file as a put's source (`reader`), the
ledger of what this node put (`ledger`), and the early sender (`early`). Never imports a stage
or the store."""
