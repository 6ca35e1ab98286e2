# Sourced by the scripts that take paths from the folder they are called from before moving to
# the clone's root: `absolute PATH` prints PATH as given when absolute, else from that folder.
# Source it before the script's first `cd`.
caller=$PWD
absolute() {
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s/%s\n' "$caller" "$1" ;;
    esac
}
