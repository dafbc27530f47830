# CPU image of draftopd (the toy target and the native engine run as on a laptop).
# Build: docker build -t draftopd:cpu .   Run: docker run --rm draftopd:cpu train recipes/toy-sft.yaml
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 1000 draftopd
WORKDIR /opt/draftopd

# torch first, from the CPU wheel index, so the project's bounds do not pull a CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY draftopd ./draftopd
COPY recipes ./recipes
RUN pip install .

USER draftopd
WORKDIR /home/draftopd
RUN cp -r /opt/draftopd/recipes ./recipes
ENTRYPOINT ["draftopd"]
CMD ["--help"]
