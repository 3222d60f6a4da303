#!/usr/bin/env bash
# Builds Tandem's image from docker/Dockerfile.<cpu|gpu> with podman (or docker where its daemon
# answers), unchanged, and reports its size:   docker/image.sh [cpu|gpu]      (`make image`)
#
# Where the Dockerfile's FROM image is neither local nor pullable (a machine without a container
# registry), a stand-in base is built first from Debian's packages (mmdebstrap, else debootstrap,
# bookworm: python3 3.11 + python3-venv, python3 also at /usr/local/bin as in python:*-slim) and
# tagged with the FROM name, so the Dockerfile stays the one users build elsewhere.
# Where the PyTorch CPU index cannot be reached but a local torch CPU wheel exists (TANDEM_WHEELS,
# default /opt/wheels), the wheel directory is mounted at build time (never copied into the image):
# --build-arg PIP_EXTRA_INDEX_URL= --build-arg PIP_FIND_LINKS=/wheels -v DIR:/wheels:ro.
#
# Environment: TANDEM_IMAGE (the tag, default tandem:0.1.0-<flavor>, the manifests' image),
# TANDEM_WHEELS (a wheels dir, "" for none), TANDEM_PODMAN_FLAGS (podman's global flags; default
# "--runtime runc --cgroup-manager=cgroupfs" where runc is installed: crun refuses hybrid cgroups),
# TANDEM_ULIMITS (default "nofile=20000:20000 nproc=4096:4096", the limits RUN steps get under podman),
# DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

FLAVOR=${1:-cpu}
case "$FLAVOR" in cpu|gpu) ;; *) echo "usage: docker/image.sh [cpu|gpu]" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DOCKERFILE=docker/Dockerfile.$FLAVOR
TAG=${TANDEM_IMAGE:-tandem:0.1.0-$FLAVOR}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOGDIR=${TANDEM_IMAGE_LOGS:-$ROOT/build/image}
mkdir -p "$LOGDIR"

# shellcheck source=docker/engine.sh
. "$ROOT/docker/engine.sh"          # ENGINE, RUNTIME_FLAGS, ULIMIT_FLAGS, or one line and exit 127

fail() {  # fail STEP LOG: the step that failed and the last lines of its output, no stack trace
    echo "image: FAILED at: $1" >&2
    if [ -n "${2:-}" ] && [ -s "$2" ]; then
        echo "---- last 30 lines of its output ($2) ----" >&2
        tail -n 30 "$2" >&2
    fi
    exit 1
}

image_exists() { "${ENGINE[@]}" image inspect "$1" >/dev/null 2>&1; }

# ---- the base image --------------------------------------------------------------------------
FROM=$(awk 'toupper($1)=="FROM"{print $2; exit}' "$DOCKERFILE")
BASE_TAG=$FROM        # what the base is imported as: podman resolves FROM's short name to docker.io
if [ "${ENGINE[0]}" = podman ]; then
    case "$FROM" in
        */*) case "${FROM%%/*}" in *.*|*:*|localhost) ;; *) BASE_TAG=docker.io/$FROM ;; esac ;;
        *) BASE_TAG=docker.io/library/$FROM ;;
    esac
fi
STANDIN_LABEL=org.tandem.base-standin
standin_of() { "${ENGINE[@]}" image inspect --format "{{ index .Labels \"$STANDIN_LABEL\" }}" "$1" 2>/dev/null || true; }
if image_exists "$FROM"; then
    STANDIN=$(standin_of "$FROM")
    case "$STANDIN" in ""|"<no value>") STANDIN=""; echo "image: base $FROM is local" ;;
        *) echo "image: base $FROM is local: a stand-in built by docker/image.sh ($STANDIN); remove it to pull the real one" ;;
    esac
else
    echo "image: pulling $FROM (60 s at most) ..."
    if timeout 60 "${ENGINE[@]}" pull "$FROM" >"$LOGDIR/pull.log" 2>&1; then
        echo "image: pulled $FROM"
    else
        echo "image: $FROM cannot be pulled ($(tail -n 1 "$LOGDIR/pull.log" | cut -c1-160))"
        case "$FROM" in
            python:3.11*bookworm*) ;;
            nvidia/cuda:*)
                echo "image: NOTE: $FROM is Ubuntu 24.04 + NVIDIA's CUDA apt repository, neither reachable here;"
                echo "image:       the stand-in is Debian bookworm's python3 (3.11): the Dockerfile's later steps"
                echo "image:       run unchanged on it, but it is not the CUDA base (see docs/PERFORMANCE.md, Images)." ;;
            *) fail "no stand-in for base image $FROM (only python:3.11-*bookworm and nvidia/cuda are known)" ;;
        esac
        STRAP=$(command -v mmdebstrap || command -v debootstrap || true)
        [ -n "$STRAP" ] || fail "building a base: neither mmdebstrap nor debootstrap is installed (apt-get install -y mmdebstrap)"
        [ "$(id -u)" = 0 ] || fail "building a base: $(basename "$STRAP") needs root here (run make image as root, or pull $FROM)"
        TAR=$LOGDIR/base-bookworm.tar
        PKGS=python3,python3-venv,ca-certificates,netbase
        # As Debian's official images (debuerreotype's docker-clean): apt keeps no .deb files, so the
        # Dockerfile's `apt-get install` leaves no 128 MB archive cache in its layer.
        CLEAN='DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";'
        export CLEAN
        echo "image: building a Debian bookworm base with $(basename "$STRAP") ($PKGS) from $MIRROR ..."
        start=$(date +%s)
        if [ "$(basename "$STRAP")" = mmdebstrap ]; then
            mmdebstrap --variant=minbase --include="$PKGS" \
                --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
                --dpkgopt='path-exclude=/usr/share/locale/*' \
                --customize-hook='ln -sf /usr/bin/python3 "$1/usr/local/bin/python3"; ln -sf /usr/bin/python3 "$1/usr/local/bin/python"' \
                --customize-hook='printf "%s\n" "$CLEAN" > "$1/etc/apt/apt.conf.d/docker-clean"; rm -f "$1"/var/cache/apt/*.bin' \
                bookworm "$TAR" \
                "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
                "deb ${MIRROR%/debian}/debian-security bookworm-security main" \
                >"$LOGDIR/base.log" 2>&1 || fail "mmdebstrap bookworm (the Debian mirror $MIRROR)" "$LOGDIR/base.log"
        else
            DIR=$LOGDIR/base-rootfs
            rm -rf "$DIR"
            debootstrap --variant=minbase --include="$PKGS" bookworm "$DIR" "$MIRROR" \
                >"$LOGDIR/base.log" 2>&1 || fail "debootstrap bookworm (the Debian mirror $MIRROR)" "$LOGDIR/base.log"
            ln -sf /usr/bin/python3 "$DIR/usr/local/bin/python3"
            ln -sf /usr/bin/python3 "$DIR/usr/local/bin/python"
            printf '%s\n' "$CLEAN" > "$DIR/etc/apt/apt.conf.d/docker-clean"
            rm -rf "$DIR/var/lib/apt/lists/"* "$DIR/var/cache/apt/"*.bin
            tar -C "$DIR" -cf "$TAR" . >>"$LOGDIR/base.log" 2>&1 || fail "packing the base" "$LOGDIR/base.log"
            rm -rf "$DIR"
        fi
        "${ENGINE[@]}" import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
            --change "LABEL $STANDIN_LABEL=debian-bookworm-python3" \
            "$TAR" "$BASE_TAG" >"$LOGDIR/import.log" 2>&1 || fail "importing the base as $FROM" "$LOGDIR/import.log"
        rm -f "$TAR"
        STANDIN=debian-bookworm-python3
        echo "image: base $FROM built from Debian bookworm in $(( $(date +%s) - start )) s"
    fi
fi

# ---- the image -------------------------------------------------------------------------------
WHEELS=${TANDEM_WHEELS-/opt/wheels}
if [ "$FLAVOR" = gpu ] && [ -z "${TANDEM_IMAGE:-}" ] && { [ -n "${STANDIN:-}" ] || [ -n "$WHEELS" ]; }; then
    # Not the GPU image: a Debian base instead of CUDA's, and (with local wheels) the CPU torch wheel
    # instead of PyPI's CUDA build (whose nvidia-* wheels are gigabytes): every other step is the
    # Dockerfile's own. TANDEM_WHEELS= (empty) asks PyPI for the CUDA torch.
    TAG=tandem:0.1.0-gpu-standin
    echo "image: building $TAG: docker/Dockerfile.gpu on stand-ins (base: ${STANDIN:-$FROM}; torch: ${WHEELS:-PyPI})"
fi
BUILD=(build --network host -f "$DOCKERFILE" -t "$TAG")      # after the tag is settled
if [ "${ENGINE[0]}" = podman ]; then
    BUILD+=(--ignorefile "$DOCKERFILE.dockerignore" "${ULIMIT_FLAGS[@]}")
fi
if [ -n "$WHEELS" ] && ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    if [ "${ENGINE[0]}" = podman ]; then
        echo "image: pip reads the local wheels in $WHEELS (mounted at /wheels for the build, not copied)"
        BUILD+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_EXTRA_INDEX_URL= --build-arg PIP_FIND_LINKS=/wheels)
    else
        echo "image: note: docker build cannot mount $WHEELS; pip uses the Dockerfile's index"
    fi
fi
# A TLS-intercepting proxy between this machine and PyPI (pip's PIP_CERT / `cert` names its CA
# bundle): the bundle is mounted for the build and pip told with the PIP_CERT build arg (not copied).
CA=${TANDEM_BUILD_CA-${PIP_CERT:-$(python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.cert='\(.*\)'$/\1/p" | head -n 1)}}
if [ -n "$CA" ] && [ -f "$CA" ] && [ "${ENGINE[0]}" = podman ]; then
    echo "image: pip trusts this machine's CA bundle $CA (mounted at /etc/tandem-build-ca.crt for the build)"
    BUILD+=(-v "$CA:/etc/tandem-build-ca.crt:ro" --build-arg PIP_CERT=/etc/tandem-build-ca.crt)
fi
echo "image: ${ENGINE[*]} ${BUILD[*]} .   (log: $LOGDIR/build-$FLAVOR.log)"
start=$(date +%s)
if ! "${ENGINE[@]}" "${BUILD[@]}" . >"$LOGDIR/build-$FLAVOR.log" 2>&1; then
    fail "$ENGINE build of $DOCKERFILE" "$LOGDIR/build-$FLAVOR.log"
fi
secs=$(( $(date +%s) - start ))
bytes=$("${ENGINE[@]}" image inspect --format '{{.Size}}' "$TAG")
"${ENGINE[@]}" image prune -f >/dev/null 2>&1 || true      # dangling layers of earlier builds
echo "image: built $TAG from $DOCKERFILE in ${secs} s; size $(awk -v b="$bytes" 'BEGIN{printf "%.2f GB (%.0f bytes)", b/1e9, b}')"
