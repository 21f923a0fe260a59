# agentstore: the data-store service.
#
#   docker build -t agentstore .
#
# compiles the service in the official Rust image and runs it on Debian slim, as a non-root user,
# on the embedded store in the volume /var/lib/agentstore. Build arguments, all optional:
#   BUILD_IMAGE    where it is compiled (default rust:1.95-slim-bookworm)
#   RUNTIME_IMAGE  what it runs on: any Debian bookworm (default debian:bookworm-slim)
#   BINARY         `compiled` (default), or `prebuilt` to take ./prebuilt/agentstore from the build
#                  context instead of compiling (a Linux x86-64 build for bookworm's glibc)
# BINARY=prebuilt needs a BuildKit builder (Docker 23 or later, or DOCKER_BUILDKIT=1), which builds
# only the stages the image uses; the default builds with any builder. scripts/containers builds it
# with BINARY=prebuilt from a Debian base made on the machine.
#
# The container refuses to serve without bearer tokens: set AGENTSTORE_TOKENS (see README,
# "Running in a container"), or AGENTSTORE_ALLOW_UNAUTHENTICATED=true where only trusted clients
# reach its port.
ARG BUILD_IMAGE=rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim
ARG BINARY=compiled

# The binary from the build context. Copied with the Dockerfile beside it so that a builder that
# runs every stage (the legacy builder, or docker-compose 1.x) does not fail here when
# ./prebuilt does not exist and the binary is compiled.
FROM scratch AS prebuilt
COPY Dockerfile prebuilt* /staging/

FROM ${BUILD_IMAGE} AS compiled
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY src ./src
COPY benches ./benches
COPY tests ./tests
COPY fixtures ./fixtures
RUN cargo build --release --locked --bin agentstore \
    && mkdir /staging && cp target/release/agentstore /staging/agentstore

FROM ${BINARY} AS binary

FROM ${RUNTIME_IMAGE}
# The HTTPS backends (Firestore, DynamoDB, CouchDB over https) verify their servers against the
# system's CA certificates, which the slim images leave out.
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --home-dir /var/lib/agentstore --create-home agentstore
COPY --from=binary /staging/agentstore /usr/local/bin/agentstore
USER agentstore
WORKDIR /var/lib/agentstore
VOLUME ["/var/lib/agentstore"]
ENV AGENTSTORE_BACKEND=embedded:/var/lib/agentstore/agentstore.redb \
    AGENTSTORE_LISTEN=0.0.0.0:8080
EXPOSE 8080
# SIGTERM: the service stops accepting, finishes the requests in flight and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["agentstore"]
CMD ["serve"]
