# fairq image: the dispatcher, workers and the fairq CLI (see compose.yaml).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir .

# Nothing at run time writes to /app; the services run unprivileged.
RUN useradd --system --uid 10001 --no-create-home fairq
USER fairq

CMD ["python", "-m", "dispatcher", "--help"]
