# fairq image: the dispatcher, workers and the fairq CLI (see compose.yaml).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir .

# Nothing at run time writes to /app; the services run unprivileged. compose.auth.yaml's
# `auth` volume starts as a copy of /auth: owned by fairq, private.
RUN useradd --system --uid 10001 --no-create-home fairq \
    && mkdir -m 0700 /auth && chown fairq /auth
USER fairq

CMD ["python", "-m", "dispatcher", "--help"]
