# syntax=docker/dockerfile:1
# The admitgate broker as a container image: one statically linked binary on an empty base
# (`FROM scratch`: no shell, no libc, no package to patch), run as a non-root user, with
# nothing written to its filesystem (a read-only root filesystem is fine).
#
#   docker build -t admitgate-broker .        # or: buildah build / podman build
#   docker run --rm -p 8080:8080 -p 9464:9464 admitgate-broker \
#       --listen 0.0.0.0:8080 --upstream http://agent:9000 --max-in-flight 20 \
#       --metrics-listen 0.0.0.0:9464
#
# The flags are the binary's (`--help`); deploy/kubernetes/ passes a --config file instead.
# docs/deploy.md says what was built and tested here.

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY . .
# Release, stripped, glibc linked in (crt-static): the binary needs nothing from the image.
RUN cp "$(deploy/build-broker)" /admitgate-broker && /admitgate-broker --version

FROM scratch
# CA roots for a rediss:// fleet backend (rustls-native-certs reads this file).
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /admitgate-broker /admitgate-broker
# The numeric id of distroless' "nonroot": no /etc/passwd is needed for a numeric USER.
USER 65532:65532
# Clients (--listen) and /metrics, /livez, /readyz (--metrics-listen).
EXPOSE 8080 9464
# The broker drains on SIGTERM: queued requests are refused, running ones get --drain-timeout.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/admitgate-broker"]
CMD ["--help"]
