# kvlab dashboard for a team: build with `docker build -t kvlab .` (GPU, through the CUDA libraries that the torch
# wheel brings) or `docker build --build-arg KVLAB_TORCH_INDEX=https://download.pytorch.org/whl/cpu -t kvlab:cpu .`
# (CPU only). It installs kvlab with its dashboard extra through scripts/install.sh, the script CI runs, so the image
# holds what CI tested. For a build behind a proxy that inspects TLS, or from wheels already on the building machine,
# PIP_CERT names a CA bundle and PIP_FIND_LINKS a directory of wheels to take first, each mounted into the build
# (`buildah bud -v` or `podman build -v`; `docker build` has no such mount); neither is kept in the image.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG KVLAB_TORCH_INDEX=""
ARG PIP_CERT
ARG PIP_FIND_LINKS
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    KVLAB_VENV=/opt/kvlab/venv \
    PATH=/opt/kvlab/venv/bin:$PATH \
    KVLAB_DB=/data/runs.duckdb \
    HF_HOME=/cache/huggingface \
    KVLAB_MODEL_CACHE=/cache/huggingface/kvlab-models \
    KVLAB_DEFAULT_MODEL=/app/kvlab/data/models/kvlab-tiny-llama \
    KVLAB_ALLOWED_MODELS="" \
    HF_HUB_OFFLINE=0 \
    KVLAB_ALLOWED_HOSTS="" \
    STREAMLIT_SERVER_ADDRESS=0.0.0.0

RUN groupadd --system --gid 10001 kvlab \
    && useradd --system --uid 10001 --gid kvlab --create-home --home-dir /home/kvlab kvlab \
    && mkdir -p /app /data /cache/huggingface/kvlab-models /opt/kvlab \
    && chown -R kvlab:kvlab /app /data /cache /opt/kvlab

WORKDIR /app
# What the install reads (the package metadata and its version) first, so that a change to the code alone does not
# reinstall the dependencies; the editable install then finds the rest of the package once it is copied in.
COPY --chown=kvlab:kvlab pyproject.toml README.md LICENSE /app/
COPY --chown=kvlab:kvlab kvlab/__init__.py /app/kvlab/__init__.py
COPY --chown=kvlab:kvlab scripts/install.sh scripts/published_models.txt /app/scripts/
USER 10001:10001
RUN KVLAB_EXTRAS=dashboard KVLAB_TORCH_INDEX="${KVLAB_TORCH_INDEX}" bash /app/scripts/install.sh
COPY --chown=kvlab:kvlab . /app

VOLUME ["/data", "/cache/huggingface"]
EXPOSE 8501
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["/opt/kvlab/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8501/_stcore/health', timeout=4)"]
CMD ["/opt/kvlab/venv/bin/python", "-m", "streamlit", "run", "app.py", "--server.port=8501"]
