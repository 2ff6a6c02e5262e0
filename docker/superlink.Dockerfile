# SuperLink image: the official flwr/superlink image plus a state directory owned by the image's
# non-root user `app` (uid 49999), so a named volume mounted at /app/state is writable and the
# SuperLink keeps runs and registered SuperNodes across restarts (--database /app/state/state.db).
# It needs neither torch nor this package: in `process` isolation the ServerApp runs in the
# superexec-serverapp container (docker/superexec.Dockerfile).
#
#   docker build -f docker/superlink.Dockerfile -t fl-dp-flower/superlink:1.41.0 docker/
ARG FLWR_VERSION=1.41.0
FROM flwr/superlink:${FLWR_VERSION}

USER root
RUN mkdir -p /app/state && chown app:app /app/state
USER app

ENV FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1

ENTRYPOINT ["flower-superlink"]
