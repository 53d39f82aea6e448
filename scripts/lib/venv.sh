# Sourced by the entry scripts: make sure .venv exists and holds the pinned dependencies.
# Reinstalls only when pyproject.toml or constraints.txt changed since the last install.

PIP_VERSION=26.3

# What an install with each extra also holds (pyproject.toml: `test` includes `chart`, `report`,
# `hf` and `data`, `local` is `chart` and `hf`; every extra includes the base), so a venv set up
# for the tests runs the demo as is.
declare -A EXTRAS_COVER=([test]="local chart report hf data base" [local]="chart hf base" [chart]="base" [report]="base")

ensure_venv() {  # usage: ensure_venv EXTRAS   (e.g. "", "chart" or "test")
  local extras="$1" python="${PYTHON:-python3}" spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  if [ ! -x .venv/bin/python ]; then
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
      echo "error: $python is $("$python" --version 2>&1); Python 3.10 or newer is needed (set PYTHON=...)" >&2
      exit 1
    }
    echo "creating .venv with $("$python" --version 2>&1)"
    "$python" -m venv .venv
    # The pip a venv starts with is as old as the Python (23.x for 3.11); the image's lock test
    # resolves for Python 3.12 with --python-version, which older pips check against this Python.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "pip==$PIP_VERSION"
  fi
  local stamp=".venv/.installed-${extras:-base}"
  local want
  want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
  local covering
  for covering in "${!EXTRAS_COVER[@]}"; do
    if [[ " ${EXTRAS_COVER[$covering]} " == *" ${extras:-base} "* ]] \
        && [ "$(cat ".venv/.installed-$covering" 2>/dev/null)" = "$want" ]; then
      return 0
    fi
  done
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing resilient-fsdp${extras:+[$extras]} with pinned dependencies (constraints.txt)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$spec"
    echo "$want" > "$stamp"
  fi
}

# What NVRx 0.7's restart paths import beyond this venv: in-process restart and ft_launcher import
# httpx (shared_utils/health_check.py), grpcio and protobuf (the launcher's log and attribution
# services); httpx brings httpcore, h11 and anyio. Installed into the lane at the image's pins
# (constraints-image.txt); certifi, idna and typing_extensions come from this venv.
NVRX_LANE_DEPS="httpx httpcore h11 anyio grpcio protobuf"

ensure_nvrx_lane() {  # the image's NVRx version, its pure-Python modules and their imports, for the test suite
  local pin version dir want
  pin="$(grep -E '^nvidia-resiliency-ext==' constraints-image.txt)"
  version="${pin#*==}"
  dir=".venv/nvrx-lane/$version"
  want="$( (echo "$NVRX_LANE_DEPS"; cat constraints-image.txt) | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$dir/.ready" 2>/dev/null)" != "$want" ]; then
    echo "preparing the NVRx $version test lane in $dir"
    rm -rf "$dir" && mkdir -p "$dir/wheel" "$dir/site"
    # Its wheels are for Python 3.12 / glibc 2.39; the modules the tests use are pure Python.
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --platform manylinux_2_39_x86_64 -d "$dir/wheel" "$pin"
    .venv/bin/python - "$dir" <<'PY'
import sys, zipfile, pathlib
root = pathlib.Path(sys.argv[1])
wheel = next((root / "wheel").glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extractall(root / "site", [n for n in z.namelist() if n.startswith("nvidia_resiliency_ext")])
PY
    # shellcheck disable=SC2086  # a list of package names
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --target "$dir/site" -c constraints-image.txt $NVRX_LANE_DEPS
    echo "$want" > "$dir/.ready"
  fi
  export RESILIENT_FSDP_NVRX_LANE="$PWD/$dir/site"
}

ensure_checkov() {  # the chart's security scanner, in a venv of its own: its pins conflict with ours
  local dir=".venv/tools/checkov" want
  want="$(sha256sum constraints-checkov.txt | cut -d' ' -f1)"
  if [ "$(cat "$dir/.installed" 2>/dev/null)" != "$want" ]; then
    echo "installing checkov into $dir (constraints-checkov.txt)"
    rm -rf "$dir"
    .venv/bin/python -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints-checkov.txt checkov
    echo "$want" > "$dir/.installed"
  fi
  export RESILIENT_FSDP_CHECKOV="$PWD/$dir/bin/checkov"
}
