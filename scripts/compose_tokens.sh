#!/bin/sh
# Tokens of the docker compose stack (installed in the image as trainguard-compose-tokens).
#
#   trainguard-compose-tokens init ROOT
#       (the compose `tokens` service, as root, before anything else starts) writes each
#       service's token files into its own folder under ROOT, one volume each, readable only by
#       the user that service runs as. A value set in the environment (from an optional .env:
#       TRAINGUARD_OPERATOR_TOKEN, ...) is written every start; otherwise a file already there is
#       kept and a missing one gets a random 256-bit token, so tokens survive restarts.
#   trainguard-compose-tokens controller DIR -- COMMAND...
#       runs COMMAND (trainguard serve) with TRAINGUARD_OPERATOR_TOKENS / TRAINGUARD_AGENT_TOKENS
#       read from DIR, after printing the operator token to the log.
#   trainguard-compose-tokens env DIR VAR=FILE... -- COMMAND...
#       runs COMMAND with each VAR set to the content of DIR/FILE.
#
# Folders and files under ROOT (the folder -> the service that mounts it):
#   controller/    operator, operator_tokens, agent_tokens          (trainguard serve)
#   trainer/       agent, demo_operator                              (the demo trainer)
#   prometheus/    trainguard_prometheus_token (read scope)          (Prometheus' credentials_file)
#   alertmanager/  trainguard_alertmanager_token (command scope)     (Alertmanager's credentials_file)
#   webhook-sink/  webhook_secret                                    (the demo webhook sink)
#   grafana/       grafana_admin_password                            (Grafana's admin)
set -eu

# uids the images run as: trainguard's own (Dockerfile), prom/* (nobody), grafana/grafana
TRAINGUARD_UID=10001
NOBODY_UID=65534
GRAFANA_UID=472

random_token() {
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n'
}

# put FOLDER FILE OWNER VALUE_FROM_ENV [secret]: write FOLDER/FILE (the environment's value, else
# the file's, else a new random one), owned by OWNER (when root), mode 0400; print the value. A
# token (not a `secret`) is checked as the controller checks it: 8 characters at least, no ':'
# or ',' (they separate a token table's entries and scopes).
put() {
    folder="$1" file="$2" owner="$3" given="$4" kind="${5:-token}"
    path="$folder/$file"
    if [ -n "$given" ]; then
        value="$given"
    elif [ -s "$path" ]; then
        value="$(cat "$path")"
    else
        value="$(random_token)"
    fi
    if [ "$kind" = token ]; then
        case "$value" in
            *[!A-Za-z0-9._~+/=-]*)
                echo "trainguard-compose-tokens: $file: a token may hold only letters, digits and ._~+/=-" >&2
                exit 2 ;;
        esac
        if [ "${#value}" -lt 8 ]; then
            echo "trainguard-compose-tokens: $file: a token must have at least 8 characters" >&2
            exit 2
        fi
    fi
    umask 077
    printf '%s' "$value" >"$path.new"
    if [ "$(id -u)" = 0 ]; then
        chown "$owner:$owner" "$path.new"
    fi
    chmod 0400 "$path.new"
    mv -f "$path.new" "$path"
    printf '%s' "$value"
}

init() {
    root="$1"
    for folder in controller trainer prometheus alertmanager webhook-sink grafana; do
        mkdir -p "$root/$folder"
        chmod 0755 "$root/$folder"
    done
    # Each client holds a token with only the scopes it needs: the operator's (CLI) every scope,
    # Prometheus read (http_sd), Alertmanager command (/v1/alertmanager), the demo trainer's
    # operator side read+command (it resumes the run it paused), its agent the agent scope.
    operator="$(put "$root/controller" operator "$TRAINGUARD_UID" "${TRAINGUARD_OPERATOR_TOKEN:-}")"
    agent="$(put "$root/trainer" agent "$TRAINGUARD_UID" "${TRAINGUARD_AGENT_TOKEN:-}")"
    demo="$(put "$root/trainer" demo_operator "$TRAINGUARD_UID" "${TRAINGUARD_DEMO_OPERATOR_TOKEN:-}")"
    prometheus="$(put "$root/prometheus" trainguard_prometheus_token "$NOBODY_UID" "${TRAINGUARD_PROMETHEUS_TOKEN:-}")"
    alertmanager="$(put "$root/alertmanager" trainguard_alertmanager_token "$NOBODY_UID" "${TRAINGUARD_ALERTMANAGER_TOKEN:-}")"
    put "$root/webhook-sink" webhook_secret "$TRAINGUARD_UID" "${TRAINGUARD_WEBHOOK_SECRET:-}" secret >/dev/null
    put "$root/grafana" grafana_admin_password "$GRAFANA_UID" "${GRAFANA_ADMIN_PASSWORD:-}" secret >/dev/null
    put "$root/controller" operator_tokens "$TRAINGUARD_UID" \
        "$operator,$prometheus:read,$alertmanager:command,$demo:read+command" secret >/dev/null
    put "$root/controller" agent_tokens "$TRAINGUARD_UID" "$agent" >/dev/null
    echo "trainguard-compose-tokens: tokens ready under $root (controller, trainer, prometheus, alertmanager, webhook-sink, grafana)"
}

read_file() {
    if [ ! -s "$1" ]; then
        echo "trainguard-compose-tokens: $1 is missing or empty (the compose 'tokens' service writes it)" >&2
        exit 2
    fi
    cat "$1"
}

expect_dashes() {
    if [ "${1:-}" != "--" ]; then
        echo "usage: trainguard-compose-tokens $mode DIR ... -- COMMAND..." >&2
        exit 2
    fi
}

mode="${1:-}"
case "$mode" in
    init)
        [ "$#" -eq 2 ] || { echo "usage: trainguard-compose-tokens init ROOT" >&2; exit 2; }
        init "$2"
        ;;
    controller)
        [ "$#" -ge 4 ] || { echo "usage: trainguard-compose-tokens controller DIR -- COMMAND..." >&2; exit 2; }
        dir="$2"
        shift 2
        expect_dashes "${1:-}"
        shift
        TRAINGUARD_OPERATOR_TOKENS="$(read_file "$dir/operator_tokens")"
        TRAINGUARD_AGENT_TOKENS="$(read_file "$dir/agent_tokens")"
        export TRAINGUARD_OPERATOR_TOKENS TRAINGUARD_AGENT_TOKENS
        echo "trainguard operator token (every scope): $(read_file "$dir/operator")"
        echo "  read it again with: docker compose exec controller cat $dir/operator"
        exec "$@"
        ;;
    env)
        [ "$#" -ge 4 ] || { echo "usage: trainguard-compose-tokens env DIR VAR=FILE... -- COMMAND..." >&2; exit 2; }
        dir="$2"
        shift 2
        while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
            var="${1%%=*}" file="${1#*=}"
            case "$var" in
                ""|*[!A-Za-z0-9_]*) echo "trainguard-compose-tokens: not VAR=FILE: $1" >&2; exit 2 ;;
            esac
            value="$(read_file "$dir/$file")"
            export "$var=$value"
            shift
        done
        expect_dashes "${1:-}"
        shift
        exec "$@"
        ;;
    *)
        echo "usage: trainguard-compose-tokens init ROOT | controller DIR -- COMMAND... | env DIR VAR=FILE... -- COMMAND..." >&2
        exit 2
        ;;
esac
