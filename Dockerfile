# fusionp2p node image: Debian slim, the build packages libp2p needs, CPU-only torch, `fusionp2p node`.
#
#   docker build -t fusionp2p .
#   docker run --rm -p 4001:4001 -p 4002:4002 -v fp2p:/home/fusion fusionp2p node \
#       --bootstrap ADDR --listen /ip4/0.0.0.0/tcp/4001 --announce-addr /ip4/PUBLIC_IP/tcp/4001 \
#       --data-listen /ip4/0.0.0.0/tcp/4002 --data-announce /ip4/PUBLIC_IP/tcp/4002
#
# The install steps mirror `make setup` (Makefile): upgrade pip, install the pinned torch on its own
# first (here from the CPU wheel index, so that no CUDA build is ever pulled), then the project.
# tests/unit/test_dockerfile.py checks that this file, the Makefile and pyproject.toml agree.
# See docs/docker.md.
FROM python:3.11-slim

# The torch pin must equal TORCH_SPEC in the Makefile (checked by tests/unit/test_dockerfile.py).
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# MALLOC_ARENA_MAX=1: one glibc heap arena for the node's threads (fusionp2p/net/heap.py)
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    MALLOC_ARENA_MAX=1

# libp2p 0.8.1 depends on fastecdsa, which compiles against GMP: a C compiler, libc headers and
# libgmp-dev (whose runtime library, libgmp10, the node needs afterwards as well).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgmp-dev \
 && rm -rf /var/lib/apt/lists/*

# Same order as `make setup`. torch comes first and in its own layer, so that editing the
# project does not re-download it.
RUN python -m pip install --upgrade pip \
 && python -m pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY fusionp2p ./fusionp2p
COPY node ./node
COPY bootstrap ./bootstrap
RUN python -m pip install . \
 && rm -rf /src/build

# Run as an unprivileged user; the node's identity key and state live in its home (a volume).
RUN useradd --create-home --home-dir /home/fusion --uid 10001 --shell /usr/sbin/nologin fusion
USER fusion
WORKDIR /home/fusion
VOLUME ["/home/fusion"]

# The libp2p listen port used in the docs (`--listen /ip4/0.0.0.0/tcp/4001`), the data-plane (tensor)
# port (`--data-listen /ip4/0.0.0.0/tcp/4002`, docs/networking.md), and the dashboard and metrics port
# of docs/operations.md (`--http 0.0.0.0:9100`; off unless asked).
EXPOSE 4001 4002 9100

ENTRYPOINT ["fusionp2p"]
CMD ["node"]
