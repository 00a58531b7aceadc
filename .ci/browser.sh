#!/usr/bin/env bash
# `make browser`: Debian's chromium and the fonts tests/explain/test_browser.py renders with, installed
# without touching unrelated system packages.
#
# A plain `apt-get install chromium` also installs what chromium-common recommends (udev, upower,
# mesa, printer tools), and udev must match the installed systemd version, so on a machine whose
# package lists are newer than its packages it upgraded systemd, perl-base and a dozen others.
# Here: only the missing packages are asked for, recommends are left out (fonts-liberation, the
# one recommend the page needs, is named), and any installed package the plan would upgrade is
# held at its installed version. When chromium cannot be had that way, nothing is installed and
# the reason is printed; tests/explain/test_browser.py then skips, saying why. Never `apt-get upgrade`.
set -uo pipefail

# BROWSER_PACKAGES and BROWSER_DRY_RUN=1 (plan and print, install nothing) are for trying this script.
read -r -a WANTED <<< "${BROWSER_PACKAGES:-chromium fonts-wqy-microhei fonts-liberation}"
SKIPPING="tests/explain/test_browser.py will skip"

missing=()
for p in "${WANTED[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "browser: already installed: ${WANTED[*]}"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser: no apt-get here to install ${missing[*]}: $SKIPPING"
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=()
elif sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "browser: installing ${missing[*]} needs root (sudo -n was refused): $SKIPPING"
    exit 0
fi

echo "browser: installing ${missing[*]} with apt (a minute or two on a new machine)"
"${SUDO[@]}" apt-get update -qq || { echo "browser: apt-get update failed: $SKIPPING"; exit 0; }

OPTS=(-y -qq --no-install-recommends --no-upgrade)
# Installed packages the plan upgrades: `Inst NAME [INSTALLED] (NEW ...)` in apt's simulation.
upgrades() { "${SUDO[@]}" apt-get install -s "${OPTS[@]}" "$@" 2>&1 | awk '/^Inst [^ ]+ \[/ {print $2}'; }
holds=()
for p in $(upgrades "${missing[@]}"); do
    holds+=("$p=$(dpkg-query -W -f='${Version}' "$p")")
done
if [ ${#holds[@]} -gt 0 ]; then
    echo "browser: holding at their installed versions what the plan would upgrade: ${holds[*]}"
    if ! "${SUDO[@]}" apt-get install -s "${OPTS[@]}" "${missing[@]}" "${holds[@]}" >/dev/null 2>&1 \
        || [ -n "$(upgrades "${missing[@]}" "${holds[@]}")" ]; then
        echo "browser: ${missing[*]} need newer versions of installed packages (${holds[*]%%=*});" \
             "not installed, so as not to upgrade them: $SKIPPING."
        echo "browser: to install them anyway: apt-get install --no-install-recommends ${missing[*]}"
        exit 0
    fi
fi
if [ -n "${BROWSER_DRY_RUN:-}" ]; then
    echo "browser: dry run: apt-get install ${OPTS[*]} ${missing[*]} ${holds[*]}"
elif "${SUDO[@]}" apt-get install "${OPTS[@]}" "${missing[@]}" "${holds[@]}"; then
    echo "browser: installed ${missing[*]}"
else
    echo "browser: apt-get install ${missing[*]} failed: $SKIPPING"
fi
exit 0
