FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md celeryconfig.py ./
COPY pipeline ./pipeline
COPY tasks ./tasks
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
CMD ["pipeline", "worker"]
