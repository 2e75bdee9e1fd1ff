# The one spotguard image: `spotguard operator`, `spotguard sidecar` and
# `spotguard restore` (the restore init container) are entry points of the
# same package. It carries no torch: the trainer runs in the user's image,
# which needs `pip install 'spotguard[torch]'` for the Checkpointer.
#
#   docker build -t spotguard/spotguard:0.1.0 .
#
# (Not built by this repository's tests: the test machines have no container
# engine; the chart's rendered manifests and the process nodes stand in.)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY spotguard ./spotguard
RUN pip install . && rm -rf /src

# Unprivileged; matches the chart's runAsUser/runAsGroup.
RUN groupadd --gid 65532 spotguard && useradd --uid 65532 --gid 65532 --no-create-home spotguard
USER 65532:65532
WORKDIR /home/spotguard

ENTRYPOINT ["spotguard"]
CMD ["--help"]
