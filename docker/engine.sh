# Sourced by docker/image.sh: the container engine to use, as bash arrays.
#   ENGINE:       podman (with TANDEM_PODMAN_FLAGS) or docker where its daemon answers
#   ULIMIT_FLAGS: --ulimit flags for podman's containers and RUN steps
# No engine: one line saying what to install, exit 127.
if command -v podman >/dev/null 2>&1; then
    if [ -n "${TANDEM_PODMAN_FLAGS+x}" ]; then
        read -r -a _flags <<<"$TANDEM_PODMAN_FLAGS"
    elif command -v runc >/dev/null 2>&1; then
        _flags=(--runtime runc --cgroup-manager=cgroupfs)   # crun refuses hybrid cgroup hierarchies
    else
        _flags=()
    fi
    ENGINE=(podman "${_flags[@]}")
    ULIMIT_FLAGS=()
    for _u in ${TANDEM_ULIMITS:-nofile=20000:20000 nproc=4096:4096}; do ULIMIT_FLAGS+=(--ulimit "$_u"); done
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    ENGINE=(docker)
    ULIMIT_FLAGS=()
else
    echo "image: no container engine: install podman (Debian/Ubuntu: apt-get install -y podman runc) or start a docker daemon" >&2
    exit 127
fi
