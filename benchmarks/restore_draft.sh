#!/usr/bin/env bash
# Brings back a draft trained on the device and kept only in git's history (drafts/NAME/*.tgz.part*,
# added by one commit and removed by the next): a tracked draft would travel with every device call,
# where the tree and one part of the model must stay under 64 MiB, and a git-excluded one is lost with
# the checkout (the thirty-ninth session's was). Usage, from the repository root:
#   benchmarks/restore_draft.sh NAME [DEST]
# writes DEST (default .carry-NAME, git-excluded) with the *.tgz.part* files that device_session26.sh's
# DRAFT= (PART=eval) and INIT= (PART=train) unpack.
set -euo pipefail
name=${1:?usage: restore_draft.sh NAME [DEST]}
dest=${2:-.carry-$name}
commit=$(git log --diff-filter=A --format=%H -1 -- "drafts/$name")
[ -n "$commit" ] || { echo "no commit added drafts/$name; allowed: $(git log --diff-filter=A --name-only --format= -- drafts \
  | cut -d/ -f2 | sort -u | tr '\n' ' ')" >&2; exit 2; }
[ ! -e "$dest" ] || { echo "$dest exists; allowed: a DEST that does not (remove it first)" >&2; exit 2; }
grep -qxF "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
tmp=$(mktemp -d "$dest.tmp.XXXXXX")  # written whole, then renamed: no half-restored DEST
trap 'rm -rf "$tmp"' EXIT
git archive "$commit" "drafts/$name" | tar x --strip-components=2 -C "$tmp"
mv "$tmp" "$dest"
echo "drafts/$name of $(git log -1 --format='%h %s' "$commit" | cut -c1-80) -> $dest"
ls -la "$dest"
