# Sourced by the entry scripts: make sure .venv exists and holds the pinned dependencies.
# Reinstalls only when pyproject.toml or constraints.txt changed since the last install.

ensure_venv() {  # usage: ensure_venv EXTRAS   (e.g. "" or "test")
  local extras="$1" python="${PYTHON:-python3}" spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  if [ ! -x .venv/bin/python ]; then
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
      echo "error: $python is $("$python" --version 2>&1); Python 3.10 or newer is needed (set PYTHON=...)" >&2
      exit 1
    }
    echo "creating .venv with $("$python" --version 2>&1)"
    "$python" -m venv .venv
  fi
  local stamp=".venv/.installed-${extras:-base}"
  local want
  want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing resilient-fsdp${extras:+[$extras]} with pinned dependencies (constraints.txt)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$spec"
    echo "$want" > "$stamp"
  fi
}
