# spotguard's two images, one build target each. The label
# `dev.spotguard.image` of a target names the image it builds (without the
# tag; images are tagged with the project's version). The chart and the
# examples name only these images (tests/unit/test_images.py checks it).
#
#   spotguard        `spotguard operator`, `spotguard sidecar` and `spotguard restore`
#                    (the restore init container): no torch. The default target.
#   spotguard-torch  a trainer image: spotguard with its torch extra, and the examples
#                    (examples/trainingjob.yaml runs it). TORCH_VARIANT picks the torch
#                    wheel: cpu (default) or a CUDA build such as cu126.
#
#   docker build --target spotguard -t spotguard/spotguard:0.1.0 .
#   docker build --target spotguard-torch --build-arg TORCH_VARIANT=cu126 -t spotguard/spotguard-torch:0.1.0 .
#
# Without a container engine, `make images` builds both targets from this file with
# buildah (testenv/images.py): a base made from Debian's packages stands in for
# PYTHON_IMAGE and a local index serves the CPU torch wheel (TORCH_INDEX_URL).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Unprivileged; matches the chart's runAsUser/runAsGroup.
RUN groupadd --gid 65532 spotguard && useradd --uid 65532 --gid 65532 --no-create-home spotguard

# The spotguard wheel, built once for both images (the source stays out of them).
FROM base AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY spotguard ./spotguard
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS spotguard-torch
LABEL dev.spotguard.image="spotguard/spotguard-torch"
# cpu, or the CUDA build of the torch wheels (cu126, cu128, ...): the CUDA
# libraries come as wheels, so the node needs only the NVIDIA driver.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
# torch first, from the index of the chosen variant: spotguard's `torch`
# extra then finds it installed instead of pulling PyPI's default build.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch
# The torch just installed is pinned (a constraint): no extra may swap it for PyPI's
# default build, a multi-GB CUDA wheel; a conflict fails the build instead. The
# dependencies of the extras below are installed first, from pyproject.toml alone,
# so that a change of spotguard's code rebuilds only the small layers after them.
COPY pyproject.toml /tmp/pyproject.toml
RUN pip freeze | grep -i '^torch==' > /tmp/torch.txt \
    && python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
        reqs = p['dependencies'] + [r for e in 'torch,hf,lightning,keras,gcs'.split(',') for r in p['optional-dependencies'][e]]; \
        print('\n'.join(r for r in reqs if not r.startswith('spotguard')))" > /tmp/deps.txt \
    && pip install -c /tmp/torch.txt -r /tmp/deps.txt && rm /tmp/deps.txt /tmp/pyproject.toml
COPY --from=wheel /wheels /tmp/wheels
# With the framework integrations (Hugging Face Trainer, Lightning).
RUN pip install -c /tmp/torch.txt "$(echo /tmp/wheels/spotguard-*.whl)[torch,hf,lightning,keras,gcs]" \
    && rm -rf /tmp/wheels /tmp/torch.txt
# The examples; examples/train*.py are links to the packaged example trainers.
COPY examples /opt/spotguard/examples
RUN for m in train train_ddp train_hf train_lightning; do \
        ln -sf "$(python -c "import importlib.util as u; print(u.find_spec('spotguard.demo.$m').origin)")" \
            "/opt/spotguard/examples/$m.py"; \
    done
USER 65532:65532
WORKDIR /home/spotguard
ENTRYPOINT []
CMD ["python", "-m", "spotguard.demo.train", "--help"]

# Last, so that a plain `docker build .` builds it.
FROM base AS spotguard
LABEL dev.spotguard.image="spotguard/spotguard"
# The dependencies first, from pyproject.toml alone (as in spotguard-torch): a change of
# spotguard's code rebuilds only the small layers after them.
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
        print('\n'.join(p['dependencies'] + p['optional-dependencies']['gcs']))" > /tmp/deps.txt \
    && pip install -r /tmp/deps.txt && rm /tmp/deps.txt /tmp/pyproject.toml
COPY --from=wheel /wheels /tmp/wheels
RUN pip install "$(echo /tmp/wheels/spotguard-*.whl)[gcs]" && rm -rf /tmp/wheels
USER 65532:65532
WORKDIR /home/spotguard
ENTRYPOINT ["spotguard"]
CMD ["--help"]
