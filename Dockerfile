# GPU image of draftopd for Ray clusters (KubeRay, SLURM with pyxis/enroot): vLLM, DeepSpeed, Ray, MLflow and
# draftopd, at the versions pyproject.toml pins. Every node of the cluster (head, workers, the RayJob submitter)
# runs this one image.
#
# Build from the repository root:   docker build -t draftopd:0.1.0 .
# The CPU image (toy target, no vLLM) is Dockerfile.cpu.
#
# Why vLLM's release image as the base, rather than a CUDA image plus `pip install ".[vllm]"`: it ships vLLM with
# the CUDA torch, FlashInfer and attention kernels it was built and tested with, on a CUDA *devel* base whose nvcc
# DeepSpeed needs to JIT-compile its ops. Resolving that stack from PyPI on a bare CUDA image redoes vLLM's own
# release work and can pair a torch with a CUDA runtime the kernels were not built for. Its tag is the vllm pin of
# pyproject's [vllm] extra; the pins below keep pip from replacing what the base image already has.
#
# These versions must agree with pyproject.toml: tests/test_dockerfile.py checks each one against it.
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}

ARG VLLM_VERSION
ARG TORCH_VERSION=2.13.0
ARG TRANSFORMERS_VERSION=5.19.0
ARG DEEPSPEED_VERSION=0.19.8
ARG RAY_VERSION=2.60.0
ARG MLFLOW_VERSION=3.17.2

# The base image installs into its system Python; in a container that is the one environment there is.
ENV PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/draftopd
COPY pyproject.toml README.md ./
COPY draftopd ./draftopd
COPY recipes ./recipes

# torch==X matches the base image's CUDA build (X+cuNNN), so pip keeps it. The last line fails the build when a
# version drifted, and when wget is missing: KubeRay's readiness probes call it.
RUN python3 -m pip install \
        "vllm==${VLLM_VERSION}" \
        "torch==${TORCH_VERSION}" \
        "transformers==${TRANSFORMERS_VERSION}" \
        "deepspeed==${DEEPSPEED_VERSION}" \
        "ray[default]==${RAY_VERSION}" \
        "mlflow==${MLFLOW_VERSION}" \
        "/opt/draftopd[vllm]" \
    && python3 -c "from importlib.metadata import version as v; \
assert v('vllm') == '${VLLM_VERSION}' and v('torch').split('+')[0] == '${TORCH_VERSION}', 'vllm/torch drifted'; \
assert v('ray') == '${RAY_VERSION}' and v('deepspeed') == '${DEEPSPEED_VERSION}', 'ray/deepspeed drifted'" \
    && command -v wget

# A non-root user with a fixed uid: the KubeRay manifests (cluster/kuberay) run pods as this uid, and the shared
# volume's files belong to it. uid 1000 is left alone (Ubuntu 24.04 images already use it).
RUN useradd --create-home --uid 1001 --user-group --shell /bin/bash draftopd
USER 1001:1001
# Jobs start here: `draftopd train recipes/NAME.yaml` finds the recipes, and `ray start` (KubeRay's, SLURM's)
# runs here, so a Ray job's entrypoint does too.
WORKDIR /home/draftopd
RUN cp -r /opt/draftopd/recipes ./recipes
ENTRYPOINT ["draftopd"]
CMD ["--help"]
