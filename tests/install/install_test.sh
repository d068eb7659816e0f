#!/usr/bin/env bash
# Installs the project into a scratch DESTDIR, then builds tests/install/consumer.cpp outside the
# tree with only `pkg-config --cflags --libs lockstep` and runs it.
#   install_test.sh BUILD_DIR SOURCE_DIR CXX
set -euo pipefail
build=$1 src=$2 cxx=$3
dest=$(mktemp -d)
trap 'rm -rf "$dest"' EXIT
meson install -C "$build" --no-rebuild --destdir "$dest" --quiet
prefix=$(meson introspect "$build" --buildoptions | python3 -c 'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"]=="prefix"))')
pc=$(find "$dest" -name lockstep.pc | head -n 1)
[[ -n "$pc" ]] || { echo "install_test: lockstep.pc was not installed"; exit 1; }
flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --define-variable=prefix="$dest$prefix" --cflags --libs lockstep)
echo "install_test: pkg-config gives: $flags"
mkdir -p "$dest/consumer"
cp "$src/tests/install/consumer.cpp" "$dest/consumer/"
cd "$dest/consumer"
# shellcheck disable=SC2086
$cxx consumer.cpp -o consumer $flags
./consumer
