# Sourced by tools/goldens/setup_*.sh (it inherits their `set -euo pipefail`): a pinned official tree,
# extracted with git archive into an oracle folder that must lie OUTSIDE this repository, whose official
# code is never copied into it.

_OFFICIAL_TREE_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# outside_repo <dest>: print <dest> as an absolute path (symlinks resolved), or fail with an error if it is
# inside this repository. Nothing is created, so a refused <dest> leaves no folder behind.
outside_repo() {
    local dest repo
    dest="$(realpath -m "$1")"
    repo="$(realpath "$_OFFICIAL_TREE_REPO_ROOT")"
    case "$dest/" in
        "$repo"/*)
            echo "error: $dest is inside the repository; pick a folder outside it" >&2
            return 1
            ;;
    esac
    printf '%s\n' "$dest"
}

# official_tree <dest> <source> <commit> <stamp> [<path>...]: unless <dest>/<stamp> already names <commit>,
# replace <dest>/tree with `git archive <commit> [<path>...]` and write <commit> to <dest>/<stamp>.
# <source> is a git dir (bare or not) or a clone URL (cloned bare into a temporary folder).
official_tree() {
    local dest="$1" source="$2" commit="$3" stamp="$4" clone
    shift 4
    local -a git_dir_arg
    if [ "$(cat "$dest/$stamp" 2>/dev/null || true)" = "$commit" ]; then
        return 0
    fi
    rm -rf "$dest/tree" "$dest/$stamp"
    if git --git-dir "$source" rev-parse --git-dir >/dev/null 2>&1; then
        git_dir_arg=(--git-dir "$source")
    elif git -C "$source" rev-parse --git-dir >/dev/null 2>&1; then
        git_dir_arg=(-C "$source")
    else
        clone="$(mktemp -d)"
        # shellcheck disable=SC2064  # expanded now: the local is gone when the trap runs
        trap "rm -rf '$clone'" EXIT
        git clone --quiet --bare "$source" "$clone/source.git"
        git_dir_arg=(--git-dir "$clone/source.git")
    fi
    mkdir -p "$dest/tree"
    git "${git_dir_arg[@]}" archive "$commit" "$@" | tar -x -C "$dest/tree"
    echo "$commit" >"$dest/$stamp"
}
