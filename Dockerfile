# One image for the operator and the workers: the `ravnest` CLI (workers: `ravnest worker ...`)
# and the operator (`kopf run -m ravnest_operator.handling`, so the `operator` extra is in).
#
#   docker build -t ravnest:0.1.0 .          # the default torch wheel of the package index (CUDA)
#   docker build --build-arg TORCH_VARIANT=cpu --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel
#       index, from PyTorch's install instructions> -t ravnest:0.1.0 .   # CPU-only torch, far smaller
#   docker build --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=<URL> ...  # from a
#       wheelhouse alone: a folder of wheels served over HTTP (`python3 -m http.server`), which the
#       build's network (--network) must reach; tests/project_image.py builds so, with no other
#       network at all. The wheels are never copied into the image or its layers.
#
# Any Debian-like base with `python3` and its `venv` module works (the venv is made with
# `python3 -m venv`), e.g. one made by `scripts/docker-engine --base`:
#   --build-arg BASE_IMAGE=ravnest-base:bookworm
#
# Layers, largest and least often changed first: torch, then the dependencies read from
# pyproject.toml, then the project's own wheel (built in the builder stage, so that no source,
# build backend or cache reaches the image). A change of our code alone rebuilds kilobytes, and
# the venv exists once: it is installed where it runs, not copied from a stage that holds it too.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# The project's own wheel: pure Python, built from the sources and nothing else.
FROM ${BASE_IMAGE} AS builder
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX=0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
COPY pyproject.toml README.md /src/
COPY worker /src/worker
COPY operator /src/operator
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-deps --wheel-dir /dist /src


FROM ${BASE_IMAGE}
# cuda: the default torch wheel of the package index (it bundles CUDA); cpu: torch from
# TORCH_INDEX_URL, PyTorch's CPU wheel index (which also serves torch's own dependencies).
# From a wheelhouse alone (PIP_NO_INDEX=1), the wheelhouse decides.
ARG TORCH_VARIANT=cuda
ARG TORCH_INDEX_URL=""
# Empty: the newest torch the project accepts; else a version such as 2.5.1.
ARG TORCH_VERSION=""
# Wheelhouses (folders or URLs, space-separated) and whether to use them alone.
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX=0
# The worker pods' runAsUser/runAsGroup (ravnest_operator.resources.WORKER_UID).
ARG WORKER_UID=10001
# pip's settings for the build's RUN steps only (an ARG, unlike an ENV, stays out of the image).
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_ROOT_USER_ACTION=ignore
RUN groupadd --gid "$WORKER_UID" ravnest \
    && useradd --uid "$WORKER_UID" --gid "$WORKER_UID" --home-dir /home/ravnest --create-home \
        --shell /usr/sbin/nologin ravnest \
    && install -d -o "$WORKER_UID" -g "$WORKER_UID" -m 0755 /work

# torch first, in its own layer: it is most of the image and changes far less often than our code.
# Without triton, which the cuda wheel pulls in (about 1 GB of the image's 6): it compiles GPU
# kernels for torch.compile, which the workers never call, and every node pulls the image. (A
# user image whose own model code calls torch.compile: `pip install triton` in it.)
RUN set -eu; \
    case "$TORCH_VARIANT" in \
        cpu) [ -n "$TORCH_INDEX_URL" ] || [ "$PIP_NO_INDEX" = 1 ] || { echo \
                 "TORCH_VARIANT=cpu needs --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index>" >&2; \
                 exit 1; }; \
             index="${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL}" ;; \
        cuda) index="" ;; \
        *) echo "TORCH_VARIANT must be 'cpu' or 'cuda', not '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac; \
    python3 -m venv /opt/venv; \
    /opt/venv/bin/pip install $index "torch${TORCH_VERSION:+==$TORCH_VERSION}"; \
    /opt/venv/bin/pip uninstall --yes triton

# Then the project's dependencies (and the operator's), read from pyproject.toml, so that a change
# of our code alone reinstalls only our code. Not torch, which is in (pip would resolve it again,
# and bring triton back).
COPY pyproject.toml /tmp/ravnest/
RUN /opt/venv/bin/python -c "import re, tomllib; \
p = tomllib.load(open('/tmp/ravnest/pyproject.toml', 'rb'))['project']; \
print(*(d for d in p['dependencies'] if not re.match(r'torch\s*([<>=!~;\[]|$)', d)), \
      *p['optional-dependencies']['operator'], sep='\n')" \
        > /tmp/ravnest/requirements.txt \
    && /opt/venv/bin/pip install -r /tmp/ravnest/requirements.txt \
    && rm -rf /tmp/ravnest

# Last, the project itself (its dependencies are in already).
COPY --from=builder /dist/ /tmp/dist/
RUN /opt/venv/bin/pip install --no-deps /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && /opt/venv/bin/ravnest --version

ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/ravnest \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /work
# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${WORKER_UID}:${WORKER_UID}
ENTRYPOINT ["ravnest"]
CMD ["--help"]
