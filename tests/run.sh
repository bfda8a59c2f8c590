#!/usr/bin/env bash
# The test command (README "Set up"; .ci/run calls it and nothing else):
#
#   bash tests/run.sh [pytest args...]
#
# 1. .venv        torch==2.13.0 (the CPU file pip finds on this machine; an unpinned torch would
#                 pull a multi-GB CUDA build), then -e ".[test]", then kernels==0.19.1 (the
#                 reference package the lock-format test checks against, and the release transformers
#                 5.25 requires (>=0.19.1,<0.20); not in .[test] because
#                 it needs huggingface_hub>=1.10, which transformers 4.57 cannot have);
#                 runs `python -m pytest ARGS`, spread over the machine's cores (pytest-xdist,
#                 one file per worker at a time; KERNEL_LOADER_TEST_WORKERS=N sets how many,
#                 0 runs everything in this process).
# 2. .venv-olah   olah==0.5.4, the loopback Hub the tests start (tests/hub_server.py); its own
#                 venv because its pins clash with ours.
# 3. .venv-tf457  the oldest supported transformers (4.57.*, which needs huggingface_hub<1),
#                 running only tests/integrations/. Runs when no pytest args are given, or with
#                 KERNEL_LOADER_TF457=1; KERNEL_LOADER_TF457=0 skips it.
#
# A venv is (re)installed only when missing or when pyproject.toml / this script changed since
# its last install (a stamp file inside it), so a second run goes straight to pytest.
# Exit status: non-zero if any step failed; pytest's 5 ("no tests collected") counts as failure.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TORCH_PIN="torch==2.13.0"
OLAH_PIN="olah==0.5.4"
KERNELS_PIN="kernels==0.19.1"
TF457_PINS=("transformers==4.57.*" "huggingface_hub<1")

# torch's CPU file is built for CPython 3.11; prefer that interpreter when it is there.
PYTHON="${KERNEL_LOADER_PYTHON:-$(command -v python3.11 || command -v python3)}"

say() { printf '\n==> %s\n' "$*"; }
die() { printf '\nERROR: %s\n' "$*" >&2; exit 1; }

stamp_of() {  # what the venv was installed from: the files that decide its contents
    cat pyproject.toml tests/run.sh | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

pip_in() {  # pip_in VENV ARGS...
    local venv="$1"; shift
    "$venv/bin/python" -m pip install --quiet --progress-bar off "$@"
}

ensure_venv() {  # ensure_venv DIR INSTALL_FUNCTION
    local venv="$1" installer="$2" stamp want
    stamp="$venv/.kernel-loader-stamp"
    want="$(stamp_of)"
    if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi
    if [[ ! -x "$venv/bin/python" ]]; then
        say "creating $venv with $("$PYTHON" --version 2>&1)"
        "$PYTHON" -m venv "$venv" || die "could not create $venv with $PYTHON"
    fi
    say "installing into $venv"
    "$installer" "$venv" || die "installing into $venv failed (see pip's output above)"
    printf '%s\n' "$want" > "$stamp"
}

install_main() {
    pip_in "$1" "$TORCH_PIN" && pip_in "$1" -e ".[test]" && pip_in "$1" "$KERNELS_PIN"
}

install_olah() {
    pip_in "$1" "$OLAH_PIN"
}

install_tf457() {
    # torch first, on its own: the transformers resolve must not pick a newer (CUDA) torch.
    pip_in "$1" "$TORCH_PIN" && pip_in "$1" -e ".[test]" "${TF457_PINS[@]}"
}

# Workers for pytest-xdist: one per core by default. A test file stays on one worker (--dist
# loadfile), so its module fixtures (a loopback Hub, a built kernel tree) start once.
WORKERS="${KERNEL_LOADER_TEST_WORKERS:-auto}"

run_pytest() {  # run_pytest VENV LABEL ARGS...; returns pytest's status, with 5 turned into 1
    local venv="$1" label="$2" rc; shift 2
    local spread=()
    [[ "$WORKERS" != 0 ]] && spread=(-n "$WORKERS" --dist loadfile)
    say "$label: $venv/bin/python -m pytest ${spread[*]} $*"
    "$venv/bin/python" -m pytest "${spread[@]}" "$@"
    rc=$?
    if [[ $rc -eq 5 ]]; then
        printf '\nERROR: %s collected no tests (pytest exit 5); that counts as a failure.\n' "$label" >&2
        rc=1
    fi
    return $rc
}

ensure_venv .venv install_main
ensure_venv .venv-olah install_olah
[[ -x .venv-olah/bin/olah-cli ]] || die ".venv-olah has no bin/olah-cli after installing $OLAH_PIN"
# Tests find olah here even if the caller has a different KERNEL_LOADER_OLAH.
export KERNEL_LOADER_OLAH="$ROOT/.venv-olah/bin/olah-cli"

status=0
run_pytest .venv "main suite" "$@" || status=1

want_tf457="${KERNEL_LOADER_TF457:-}"
if [[ -z "$want_tf457" ]]; then
    [[ $# -eq 0 ]] && want_tf457=1 || want_tf457=0
fi
if [[ "$want_tf457" == 1 ]]; then
    if [[ -d tests/integrations ]]; then
        ensure_venv .venv-tf457 install_tf457
        run_pytest .venv-tf457 "transformers 4.57 bridge" tests/integrations || status=1
    else
        say "tests/integrations/ does not exist yet: no transformers 4.57 step"
    fi
fi

if [[ $status -ne 0 ]]; then
    say "FAILED (see above)"
else
    say "all test steps passed"
fi
exit $status
