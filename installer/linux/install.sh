#!/usr/bin/env bash
# Install Strata for one user (or system-wide with --prefix /usr/local) into its own virtualenv.
#
#   install.sh [--prefix DIR] [--python PY] [--system-site-packages] [--torch auto|cpu|cuda]
#              [--autostart]
#   install.sh --uninstall [--prefix DIR] [--purge-models]
#
# PyTorch is pinned to 2.13.0 (the version Strata is tested with). --torch picks its build:
# auto (the default) takes the CUDA build where an NVIDIA driver is present (about 4 GB to
# download with its CUDA libraries) and the CPU build elsewhere (about 200 MB, from PyTorch's
# CPU index). Strata's other packages (Qt for the tray, aiohttp, tokenizers, ...) add a few
# hundred MB.
#
# Layout under the prefix (default ~/.local):
#   lib/strata/venv/              the virtualenv that holds Strata and its dependencies
#   lib/strata/installed-files    what this script created, so --uninstall removes exactly that
#   bin/strata, bin/strata-tray   links into the venv
#   share/applications/strata.desktop, share/icons/hicolor/scalable/apps/strata.svg
# --autostart writes the same login entry the tray's own "Start at login" switch writes
# ($XDG_CONFIG_HOME/autostart/strata-tray.desktop), so the two never disagree.
#
# STRATA_SOURCE picks what pip installs: a source checkout or a built .whl; default: the
# checkout this script lives in. Models, snapshots and the config file live outside the prefix
# and survive an uninstall; --purge-models also deletes the model cache.
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="${HOME}/.local"
python=""
is_uninstall=0
is_purge_models=0
is_autostart=0
torch_build="auto"
venv_options=()
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }

usage() {  # the whole comment block at the top of this file
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix="$2"; shift 2 ;;
        --prefix=*) prefix="${1#*=}"; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs an interpreter"; python="$2"; shift 2 ;;
        --python=*) python="${1#*=}"; shift ;;
        --system-site-packages) venv_options+=(--system-site-packages); shift ;;
        --autostart) is_autostart=1; shift ;;
        --torch) [ $# -ge 2 ] || die "--torch needs auto, cpu or cuda"; torch_build="$2"; shift 2 ;;
        --torch=*) torch_build="${1#*=}"; shift ;;
        --uninstall) is_uninstall=1; shift ;;
        --purge-models) is_purge_models=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1'; run install.sh --help" ;;
    esac
done

[ -n "$prefix" ] || die "--prefix is empty; give a directory such as ~/.local"
if [ "$is_purge_models" = 1 ] && [ "$is_uninstall" = 0 ]; then
    die "--purge-models only goes with --uninstall"
fi
case "$torch_build" in
    auto|cpu|cuda) ;;
    *) die "--torch takes auto, cpu or cuda, not '$torch_build'" ;;
esac
# Absolute, without creating it: install records the folders it makes, so that --uninstall
# removes a prefix it created and leaves no empty folders behind.
prefix="$(realpath -m -- "$prefix")" || die "cannot resolve prefix $prefix"
# A .desktop Exec line must hold the path; quoting covers spaces, nothing stranger.
case "$prefix" in
    *[!A-Za-z0-9/._+\ -]*) die "prefix '$prefix' has characters a launcher cannot hold; pick one of letters, digits, / . _ + - and spaces" ;;
esac

app_dir="$prefix/lib/strata"
venv="$app_dir/venv"
manifest="$app_dir/installed-files"
autostart_file="${XDG_CONFIG_HOME:-$HOME/.config}/autostart/strata-tray.desktop"

# Manifest lines: "d PATH" for a directory we created, "f PATH" for a file or link we wrote.
make_dir() {
    local dir="$1" missing=() parent="$1"
    while [ ! -d "$parent" ]; do missing=("$parent" "${missing[@]}"); parent="$(dirname "$parent")"; done
    for dir in "${missing[@]}"; do mkdir "$dir"; done
    # Recorded after creating them all: the first call creates the manifest's own folder.
    for dir in "${missing[@]}"; do echo "d $dir" >>"$manifest"; done
}

put_file() {  # put_file SOURCE DEST: copy, recorded
    make_dir "$(dirname "$2")"
    cp "$1" "$2"
    chmod 644 "$2"
    echo "f $2" >>"$manifest"
}

put_link() {  # put_link TARGET LINK
    make_dir "$(dirname "$2")"
    ln -sfn "$1" "$2"
    echo "f $2" >>"$manifest"
}

model_cache_dir() {
    # Strata's own answer when it still runs; the same rule in shell otherwise (strata/paths.py).
    "$venv/bin/python" -c 'from strata.paths import model_cache_dir; print(model_cache_dir())' 2>/dev/null \
        || echo "${STRATA_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/strata}/models"
}

remove_installed_files() {
    rm -rf "$venv"
    local kind path dirs=()
    while read -r kind path; do
        case "$kind" in
            f) rm -f "$path" ;;
            d) dirs=("$path" "${dirs[@]}") ;;  # deepest last recorded: remove in reverse
        esac
    done <"$manifest"
    rm -f "$manifest"
    rmdir "$app_dir" 2>/dev/null || true
    for path in "${dirs[@]}"; do rmdir "$path" 2>/dev/null || true; done  # only if now empty
}

has_nvidia_driver() {
    [ -e /proc/driver/nvidia/version ] || nvidia-smi -L >/dev/null 2>&1
}

install_torch() {  # the pinned PyTorch first, so that installing Strata keeps it
    local build="$torch_build" index_args=()
    if [ "$build" = auto ]; then
        if has_nvidia_driver; then build=cuda; else build=cpu; fi
    fi
    if [ "$build" = cpu ]; then
        index_args=(--index-url "$TORCH_CPU_INDEX")
        say "installing PyTorch $TORCH_VERSION, CPU build (no NVIDIA driver found, or --torch cpu; about 200 MB to download)"
    else
        say "installing PyTorch $TORCH_VERSION, CUDA build (an NVIDIA driver is present, or --torch cuda; about 4 GB to download with its CUDA libraries)"
    fi
    "$venv/bin/python" -m pip install --disable-pip-version-check "${index_args[@]}" "torch==$TORCH_VERSION" \
        || die "pip could not install torch==$TORCH_VERSION ($build build); see its message above"
}

uninstall() {
    [ -f "$manifest" ] || die "no Strata installation under $prefix ($manifest is missing); check --prefix"
    local models=""
    [ "$is_purge_models" = 1 ] && models="$(model_cache_dir)"
    if [ -f "$autostart_file" ] && grep -qF "$prefix/" "$autostart_file"; then
        rm -f "$autostart_file"
        rmdir "$(dirname "$autostart_file")" 2>/dev/null || true  # only if that left it empty
        say "removed the login entry $autostart_file"
    fi
    remove_installed_files
    say "removed Strata from $prefix"
    if [ -n "$models" ]; then
        if [ -L "$models" ]; then
            rm -f "$models"; say "removed the link $models (the folder it pointed to is kept)"
        elif [ -d "$models" ]; then
            rm -rf "$models"; say "deleted the model cache $models"
        fi
    else
        say "kept models, snapshots and the config file; --purge-models deletes the models too"
    fi
}

find_python() {
    local check='import sys; sys.exit(sys.version_info < (3, 11))' candidate
    if [ -n "$python" ]; then
        command -v "$python" >/dev/null 2>&1 || die "cannot run '$python'; pass an installed interpreter with --python"
        "$python" -c "$check" 2>/dev/null || die "$python is older than Python 3.11; pass a newer one with --python"
        echo "$python"; return 0
    fi
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$check" 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    die "no Python >= 3.11 found; install one (e.g. apt install python3.11-venv) or pass --python"
}

find_source() {
    local source="${STRATA_SOURCE:-}"
    if [ -z "$source" ]; then
        source="$(cd "$script_dir/../.." && pwd)"
        [ -f "$source/pyproject.toml" ] || die "not run from a Strata checkout; set STRATA_SOURCE to a checkout or a .whl file"
    fi
    case "$source" in
        *.whl) [ -f "$source" ] || die "STRATA_SOURCE=$source does not exist" ;;
        *) [ -f "$source/pyproject.toml" ] || die "STRATA_SOURCE=$source is not a Strata checkout (no pyproject.toml) nor a .whl file" ;;
    esac
    echo "$source"
}

install() {
    local interpreter source launcher icon exec_path
    interpreter="$(find_python)"
    source="$(find_source)"
    [ -f "$script_dir/strata.desktop" ] || die "$script_dir/strata.desktop is missing; run the script from its installer/linux folder"
    if [ -f "$manifest" ]; then  # an upgrade: the login entry, models and settings stay
        say "replacing the existing installation in $prefix"
        remove_installed_files
    fi
    make_dir "$app_dir"
    say "creating a virtualenv in $venv with $interpreter"
    "$interpreter" -m venv "${venv_options[@]}" "$venv" \
        || die "could not create a virtualenv; on Debian/Ubuntu: apt install python3-venv"
    install_torch
    say "installing Strata from $source"
    "$venv/bin/python" -m pip install --disable-pip-version-check "$source" \
        || die "pip could not install $source; see its message above"
    make_dir "$prefix/bin"
    put_link "$venv/bin/strata" "$prefix/bin/strata"
    put_link "$venv/bin/strata-tray" "$prefix/bin/strata-tray"

    icon="$("$venv/bin/python" -c 'from importlib.resources import files; print(files("strata.resources") / "icons" / "strata.svg")')"
    put_file "$icon" "$prefix/share/icons/hicolor/scalable/apps/strata.svg"
    exec_path="$prefix/bin/strata-tray"
    case "$exec_path" in *" "*) exec_path="\"$exec_path\"" ;; esac
    launcher="$prefix/share/applications/strata.desktop"
    make_dir "$(dirname "$launcher")"
    sed -e "s|^Exec=.*|Exec=$exec_path|" -e "s|^TryExec=.*|TryExec=$prefix/bin/strata-tray|" \
        -e "s|^Icon=.*|Icon=$prefix/share/icons/hicolor/scalable/apps/strata.svg|" \
        "$script_dir/strata.desktop" >"$launcher"
    echo "f $launcher" >>"$manifest"

    if [ "$is_autostart" = 1 ]; then
        "$venv/bin/python" -c 'import sys; from strata.app.autostart import set_autostart; set_autostart(True, [sys.argv[1]])' \
            "$prefix/bin/strata-tray"
        say "Strata's tray starts at login ($autostart_file)"
    fi
    say "installed $("$prefix/bin/strata" --version) into $prefix"
    case ":$PATH:" in
        *":$prefix/bin:"*) ;;
        *) say "add $prefix/bin to your PATH to run 'strata' and 'strata-tray' by name" ;;
    esac
}

if [ "$is_uninstall" = 1 ]; then uninstall; else install; fi
