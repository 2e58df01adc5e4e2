# slogate gateway image: slim, non-root, with a liveness healthcheck.
#   docker build -t slogate .
#   docker run -p 8000:8000 -v $PWD/deploy/gateway.sim.yaml:/etc/slogate/gateway.yaml -e SLOGATE_CONFIG=/etc/slogate/gateway.yaml slogate
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY slogate slogate
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin slogate
USER 10001
# Writable scratch only under /tmp (Kubernetes mounts an emptyDir there; the root filesystem is read-only).
ENV HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /tmp
EXPOSE 8000
# /health/live answers while the event loop does; readiness (/health/ready) is for load balancers.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/live', timeout=2)"]
ENTRYPOINT ["slogate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
