# Sourced by the deploy scripts: install Debian packages that are missing, once, the same way everywhere.
#
#   apt_install COMMAND PACKAGE...   nothing when COMMAND is on PATH; else apt-get update and install the
#                                    packages (as root, or through sudo), then insist COMMAND is there
#
# The caller defines die (prints its error and exits).

apt_install() {
    local command="$1" sudo=()
    shift
    command -v "$command" >/dev/null 2>&1 && return 0
    command -v apt-get >/dev/null 2>&1 ||
        die "$command is not installed and apt-get is unavailable: install $* by hand ($command on PATH)"
    if [[ $EUID -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "$command is missing and installing $* needs root (no sudo found)"
        sudo=(sudo)
    fi
    echo "installing $* with apt-get ..." >&2
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -q >&2 ||
        die "apt-get update failed"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
        --no-install-recommends "$@" >&2 || die "apt-get install $* failed"
    command -v "$command" >/dev/null 2>&1 || die "apt-get installed $* but $command is still not on PATH"
}
