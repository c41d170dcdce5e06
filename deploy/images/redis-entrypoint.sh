#!/bin/sh
# Flags alone mean redis-server's flags; redis-server without a configuration file gets --protected-mode no.
set -e
case "$1" in -*) set -- redis-server "$@" ;; esac
if [ "$1" = redis-server ]; then
    case "$2" in
    *.conf) ;;
    *) set -- "$@" --protected-mode no ;;
    esac
fi
exec "$@"
