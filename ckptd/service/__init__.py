"""The daemon's services: each long-lived thread's work (`scan`, `workers`, `retention`'s loop,
`discovery`, `persist`, `memory`, `lease` with its files in `lease_files`, `globs`), the supervisor
that runs them and keeps the call board (`supervisor`), the daemon's health and the
watchdog's answer (`health`), the one hook after a transition (`effects`), start-up
(`recovery`), the stage calls of a claimed job (`runners`, `jobs`, `uploads`, `progress`,
`commits`), and what the daemon reports (`metrics`, `observe`, `sdnotify`)."""
