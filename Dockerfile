# trainguard image: the controller (`trainguard serve`), the demo trainer (`trainguard demo`, CPU
# torch, gloo) and the webhook sink, all from this repository. Used by docker-compose.yml.
#
# Torch comes from the default package index unless TORCH_INDEX_URL names another one; point it at
# PyTorch's CPU-only wheel index for an image without the CUDA libraries (about 1 GB instead of
# several; see README, "The full stack").
FROM python:3.11.13-slim-bookworm

ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1

WORKDIR /app
# Torch first, in its own layer: it is by far the largest and changes least often.
COPY pyproject.toml README.md ./
RUN torch_pin="$(python -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); print(next(x for x in d["project"]["dependencies"] if x.startswith("torch==")))')" \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
         pip install --index-url "$TORCH_INDEX_URL" "$torch_pin"; \
       else \
         pip install "$torch_pin"; \
       fi

COPY trainer_agent ./trainer_agent
COPY service ./service
COPY dashboards ./dashboards
RUN pip install '.[service]' \
    && useradd --create-home --uid 10001 trainguard \
    && mkdir -p /data && chown trainguard /data

USER trainguard
VOLUME ["/data"]
EXPOSE 8000
# The controller's health; the other services that run this image override it in compose.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"
CMD ["trainguard", "serve", "--host", "0.0.0.0", "--port", "8000", "--db", "/data/trainguard.db"]
