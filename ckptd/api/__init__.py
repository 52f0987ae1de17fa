"""The daemon's socket API: HTTP/1.1 + JSON over a Unix socket (docs/CLI.md, "Socket API").
`server` speaks HTTP, `checks` vets what a client sends, `documents` answers from the store and
the services, `seams` says what it needs of them (protocols), `door` accepts connections and
the descriptors sent with them."""
