"""The daemon's services: each long-lived thread's work (scan, workers, retention's loop,
discovery), the supervisor that runs them, start-up recovery and the stage calls of a job."""
