"""Framework integrations: a Lightning `Callback` and a Hugging Face `TrainerCallback` that
register each save with the daemon, wait for its upload at the end of training and flush on a
preemption signal, and the resume helpers that name the checkpoint a framework resumes from
(restored from the bucket when this node has none). `common` holds what they share
(registering, the flush and its bounded wait, `resume`), framework-free; `lightning` and `hf`
each import their framework, so importing this package imports neither. Talks to the daemon
only through `ckptd.client`; never imports the daemon."""

from ckptd.integrations.common import Resume, flush_and_wait, resume

__all__ = ["Resume", "flush_and_wait", "resume"]
