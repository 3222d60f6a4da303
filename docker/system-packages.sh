#!/bin/sh
# `make setup`'s system step: install the Debian packages named in $@ where we can (root with
# apt-get, as in CI and docker/), else print what is missing. Never fails: the suite runs without them.
missing=""
for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    apt-get install -y --no-install-recommends $missing >/dev/null 2>&1 \
        || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends $missing >/dev/null 2>&1; } \
        || echo "make setup: could not install:$missing"
else
    echo "make setup: not installed (apt-get install them as root):$missing"
fi
exit 0
