# syntax=docker/dockerfile:1
# ckptd's container image: the daemon, the CLI and the client, as a non-root user.
#
#   docker build -t ckptd .                                  # slim: no PyTorch
#   docker build -t ckptd:torch --build-arg CKPTD_EXTRAS=torch .   # deep_validate (CPU torch)
#
# It runs `ckptd run --config /etc/ckptd/ckptd.toml`: mount the config there, the socket
# directory on /run/ckptd, the state on /var/lib/ckptd and each root at the path the config
# names. Any other command runs in its place: `docker run --rm IMAGE config check ...`.
# Kubernetes: deploy/kubernetes/README.md.

ARG PYTHON_IMAGE=python:3.11-slim

# -- build: the ckptd wheel and every wheel it needs, so the runtime installs offline ----------
FROM ${PYTHON_IMAGE} AS build
# Extras to install with the package: "" (the daemon alone) or "torch" (deep_validate, ckptd.torch).
ARG CKPTD_EXTRAS=""
# Where the torch extra's CPU-only build comes from (the default index would pull CUDA).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in CHANGELOG.md config.example.toml ./
COPY systemd ./systemd
COPY ckptd ./ckptd
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && pip wheel --no-cache-dir --wheel-dir /wheels \
        ${CKPTD_EXTRAS:+--extra-index-url "$TORCH_INDEX"} \
        "$(ls /wheels/ckptd-*.whl)${CKPTD_EXTRAS:+[$CKPTD_EXTRAS]}"

# -- runtime --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG CKPTD_EXTRAS=""
# The daemon's user and group. Training containers that use its socket run with this gid as
# their group (or among their supplementary groups): the socket is mode 0660.
ARG CKPTD_UID=10001
ARG CKPTD_GID=10001
LABEL org.opencontainers.image.title="ckptd" \
      org.opencontainers.image.description="Checkpoint daemon for ML training: validates, compresses, uploads and prunes checkpoints" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid "$CKPTD_GID" ckptd \
 && useradd --system --uid "$CKPTD_UID" --gid ckptd --home-dir /var/lib/ckptd \
        --no-create-home --shell /usr/sbin/nologin ckptd \
 && install -d -o ckptd -g ckptd -m 0750 /var/lib/ckptd /run/ckptd \
 && install -d -o root -g ckptd -m 0750 /etc/ckptd
# The wheels come in through a bind mount: none of them stays in a layer of the image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels \
        "$(ls /wheels/ckptd-*.whl)${CKPTD_EXTRAS:+[$CKPTD_EXTRAS]}" \
 && ckptd --version
COPY config.example.toml /usr/share/doc/ckptd/config.example.toml

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CKPTD_CONFIG=/etc/ckptd/ckptd.toml
# The socket directory and the state (SQLite, scratch): both outlive the container.
VOLUME ["/run/ckptd", "/var/lib/ckptd"]
# Prometheus metrics, when the config sets `[metrics] listen = ":9464"`.
EXPOSE 9464
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER ${CKPTD_UID}:${CKPTD_GID}
WORKDIR /var/lib/ckptd

# `ckptd probe live`: exit 0 while the daemon answers and makes progress (docs/CLI.md). The
# start period covers the first scan of large roots, before the socket answers.
HEALTHCHECK --interval=30s --timeout=10s --start-period=5m --retries=3 \
    CMD ["ckptd", "probe", "live"]
# The daemon stops gracefully on SIGTERM: in-flight stages get 20 s, then 5 s to cancel.
# Give `docker stop` more than that: `docker stop -t 60`.
STOPSIGNAL SIGTERM
# umask 0007 as the systemd unit's UMask=: what ckptd writes into the roots is readable by
# its group, never by everyone. exec: ckptd is PID 1 and gets the signals itself (it
# installs its own handlers, and waits for each child process it starts).
ENTRYPOINT ["/bin/sh", "-c", "umask 0007 && exec ckptd \"$@\"", "ckptd"]
CMD ["run", "--config", "/etc/ckptd/ckptd.toml"]
