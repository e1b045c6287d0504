# trainguard images, from this repository (used by docker-compose.yml):
#   target `controller` (default): the controller (`trainguard serve`) and the webhook sink. No torch:
#     the controller never imports it.
#   target `trainer`: the controller image plus CPU torch, for the demo trainer (`trainguard demo`).
#
# Torch comes from the default package index unless TORCH_INDEX_URL names another one; point it at
# PyTorch's CPU-only wheel index for a trainer image without the CUDA libraries (see
# docs/dashboards.md, "The full stack").
FROM python:3.11.13-slim-bookworm AS controller

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1

WORKDIR /app
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY trainguard ./trainguard
COPY trainer_agent ./trainer_agent
COPY service ./service
COPY dashboards ./dashboards
# docker-compose.yml's token set-up: its `tokens` service writes them, the others read their own
COPY scripts/compose_tokens.sh /usr/local/bin/trainguard-compose-tokens
RUN grep -v '^torch==' constraints.txt > /tmp/constraints-controller.txt \
    && pip install -c /tmp/constraints-controller.txt '.[service,dashboards,postgres]' \
    && chmod 0755 /usr/local/bin/trainguard-compose-tokens \
    && useradd --create-home --uid 10001 trainguard \
    && mkdir -p /data && chown trainguard /data

USER trainguard
VOLUME ["/data"]
EXPOSE 8000
# The controller's health; the other services that run these images override it in compose.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"
CMD ["trainguard", "serve", "--host", "0.0.0.0", "--port", "8000", "--db", "/data/trainguard.db"]

FROM controller AS trainer
ARG TORCH_INDEX_URL=""
USER root
RUN torch_pin="$(grep '^torch==' constraints.txt)" \
    && if [ -n "$TORCH_INDEX_URL" ]; then \
         pip install --index-url "$TORCH_INDEX_URL" "$torch_pin"; \
       else \
         pip install "$torch_pin"; \
       fi
USER trainguard
