# syntax=docker/dockerfile:1
# The engine image of deploy/k8s: vLLM's own OpenAI server image, at a release
# mmcache's plugin is tested with, plus mmcache's client (the vLLM plugin and
# the EC connector). `MMCACHE_TARGET` turns the plugin on; unset, it is inert.
#
#   docker build -f deploy/docker/engine.Dockerfile -t mmcache-vllm:0.2.0 .
#
# The build context is the repository root. vLLM's image brings its CUDA
# torch; mmcache's client asks torch for a range only, so pip keeps vLLM's.
# No constraints.txt here: it pins the CPU torch of this repository's tests.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
WORKDIR /tmp/mmcache
COPY pyproject.toml README.md ./
COPY core/ core/
COPY server/ server/
COPY client/ client/
COPY metrics/ metrics/
COPY proto/ proto/
RUN python3 -m pip install --no-cache-dir ".[client]" \
    && python3 -c "import mmcache.client.vllm, mmcache.client.vllm.connector" \
    && rm -rf /tmp/mmcache
WORKDIR /
