# rein-local/python:3.11 — what python:3.11-slim gives the Dockerfile, from Debian's packages:
# `python` and `pip` on PATH (a venv at /opt/python that pip may install into), useradd, and the
# host's CA bundle, so pip behind a TLS-inspecting proxy trusts what the host trusts.
ARG DEBIAN_IMAGE=rein-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
COPY ca-certificates.crt /usr/local/share/rein/ca-certificates.crt
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/python \
    && ln -s /opt/python/bin/python3 /usr/local/bin/python
ENV PATH=/opt/python/bin:$PATH \
    PIP_CERT=/usr/local/share/rein/ca-certificates.crt \
    LANG=C.UTF-8
CMD ["python3"]
