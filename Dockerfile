# agentstore: the data-store service. Build: docker build -t agentstore .
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml ./
COPY src ./src
COPY benches ./benches
COPY tests ./tests
COPY fixtures ./fixtures
RUN cargo build --release --locked --bin agentstore

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/agentstore --create-home agentstore
COPY --from=build /src/target/release/agentstore /usr/local/bin/agentstore
USER agentstore
WORKDIR /var/lib/agentstore
VOLUME ["/var/lib/agentstore"]
ENV AGENTSTORE_BACKEND=embedded:/var/lib/agentstore/agentstore.redb \
    AGENTSTORE_LISTEN=0.0.0.0:8080
EXPOSE 8080
STOPSIGNAL SIGTERM
ENTRYPOINT ["agentstore"]
CMD ["serve"]
