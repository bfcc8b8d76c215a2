# One image for the operator and the workers: the `ravnest` CLI (workers: `ravnest worker ...`)
# and the operator (`kopf run -m ravnest_operator.handling`, so the `operator` extra is in).
#
#   docker build -t ravnest:0.1.0 .          # the default torch wheel of the package index (CUDA)
#   docker build --build-arg TORCH_VARIANT=cpu --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel
#       index, from PyTorch's install instructions> -t ravnest:0.1.0 .   # CPU-only torch, far smaller
#   docker build --network none --build-arg PIP_NO_INDEX=1 ...  # offline, from a wheelhouse:
#       a `wheels/` folder in the build context and/or --build-arg PIP_FIND_LINKS=<dir or URL>
#
# Any Debian-like base with `python3` and its `venv` module works (the venv is made with
# `python3 -m venv`), e.g. one made by `scripts/docker-engine --base`:
#   --build-arg BASE_IMAGE=ravnest-base:bookworm
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
# cuda: the default torch wheel of the package index (it bundles CUDA); cpu: torch from
# TORCH_INDEX_URL, PyTorch's CPU wheel index (which also serves torch's own dependencies).
# Offline (PIP_NO_INDEX=1) the wheelhouse decides.
ARG TORCH_VARIANT=cuda
ARG TORCH_INDEX_URL=""
# Empty: the newest torch the project accepts; else a version such as 2.5.1.
ARG TORCH_VERSION=""
# Extra wheelhouses (folders or URLs, space-separated) and whether to use them alone.
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX=0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

# The optional wheelhouse: `wheel[s]` matches nothing when the context has no wheels/ folder, and
# COPY needs one source that exists, hence .dockerignore beside it (harmless among the wheels).
COPY .dockerignore wheel[s] /wheels/

# torch first, in its own layer: it is most of the image and changes far less often than our code.
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
    PIP_FIND_LINKS="/wheels $PIP_FIND_LINKS" \
        /opt/venv/bin/pip install $index "torch${TORCH_VERSION:+==$TORCH_VERSION}"

# Then the project's dependencies (and the operator's), read from pyproject.toml, so that a change
# of our code alone reinstalls only our code.
COPY pyproject.toml /src/
RUN /opt/venv/bin/python -c "import tomllib; \
p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print(*p['dependencies'], *p['optional-dependencies']['operator'], sep='\n')" > /tmp/requirements.txt \
    && PIP_FIND_LINKS="/wheels $PIP_FIND_LINKS" /opt/venv/bin/pip install -r /tmp/requirements.txt

COPY README.md /src/
COPY worker /src/worker
COPY operator /src/operator
RUN PIP_FIND_LINKS="/wheels $PIP_FIND_LINKS" /opt/venv/bin/pip install "/src[operator]" \
    && /opt/venv/bin/ravnest --version


# The final stage gets the venv and nothing else from the builder: no sources, wheels, compilers
# or caches.
FROM ${BASE_IMAGE}
# The worker pods' runAsUser/runAsGroup (ravnest_operator.resources.WORKER_UID).
ARG WORKER_UID=10001
RUN groupadd --gid "$WORKER_UID" ravnest \
    && useradd --uid "$WORKER_UID" --gid "$WORKER_UID" --home-dir /home/ravnest --create-home \
        --shell /usr/sbin/nologin ravnest \
    && install -d -o "$WORKER_UID" -g "$WORKER_UID" -m 0755 /work
COPY --from=builder /opt/venv /opt/venv
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
