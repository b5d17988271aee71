# bash completion for ddprun. Installed as share/bash-completion/completions/ddprun; to try it
# from the source tree: `source deploy/completion/ddprun.bash`.
# The flags come from the program itself (`ddprun --help`, `ddprun store --help`, ...), read once
# per shell, so they never fall behind the binary. Before the program: flags, their values where
# they are a fixed set or a file, and .conf/.py files; after a train.conf: its section.key=
# overrides (from `ddpworker --keys`); after any other program: files.

# _ddprun_flags CMD [SUBCOMMAND]: every flag its --help lists, one a line; a flag shown followed by
# a value (`--log-dir DIR`, `-o FILE`) is printed a second time as =FLAG. Cached per subcommand.
_ddprun_flags() {
    local cmd=$1 sub=$2 var="_ddprun_cache_${2//-/_}"
    if [[ -z ${!var-} ]]; then
        local m flags="" short re='^(-[[:alnum:]]), (.*)$'
        local flag_re='(^|[[:space:][])(-[[:alnum:]], )?--[[:alnum:]][[:alnum:]_-]*'
        flag_re+='( [^[:space:](-][^[:space:]]*)?'
        while IFS= read -r m; do
            m=${m#"${m%%-*}"} # the match may start with the blank before the flag
            short=""
            if [[ $m =~ $re ]]; then short=${BASH_REMATCH[1]}; m=${BASH_REMATCH[2]}; fi
            flags+="${m%% *} $short "
            if [[ $m == *" "* ]]; then flags+="=${m%% *} ${short:+=$short} "; fi
        done < <("$cmd" ${sub:+"$sub"} --help 2>/dev/null | grep -oE "$flag_re")
        printf -v "$var" '%s' "$flags"
    fi
    printf "%s\n" ${!var} | sort -u
}

_ddprun() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    local cmd=${COMP_WORDS[0]} sub="" i start=1 word
    COMPREPLY=()
    case ${COMP_WORDS[1]-} in
        store | store-client | status | plot) sub=${COMP_WORDS[1]}; start=2 ;;
    esac

    local -a flags=() valued=()
    for word in $(_ddprun_flags "$cmd" "$sub"); do
        if [[ $word == =* ]]; then valued+=("${word#=}"); else flags+=("$word"); fi
    done
    [[ $sub == plot ]] && valued+=(-o) # argparse shows it as `-o FILE, --output FILE`

    # the program (first word that is neither a flag nor a flag's value) ends ddprun's own flags
    local program="" after=0
    for ((i = start; i < COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        if [[ -n $program ]]; then after=1; break; fi
        if [[ $word == -- ]]; then program=--; continue; fi
        if [[ $word == -* ]]; then
            [[ $word != *=* && " ${valued[*]} " == *" $word "* ]] && ((i++))
            continue
        fi
        [[ -z $sub ]] && program=$word
    done
    [[ -n $program && $program != -- ]] && after=1

    if ((after)); then
        if [[ $program == *.conf ]]; then
            # the ddpworker ddprun would run: next to it, in its build tree, else on PATH
            local dir worker=ddpworker
            dir=$(dirname -- "$(command -v -- "$cmd" 2>/dev/null || echo "$cmd")")
            if [[ -x $dir/ddpworker ]]; then worker=$dir/ddpworker
            elif [[ -x $dir/../worker/ddpworker ]]; then worker=$dir/../worker/ddpworker; fi
            local keys
            keys=$("$worker" --keys 2>/dev/null | sed -n 's/^\([a-z_]*\.[a-z_0-9]*\) =.*/\1=/p')
            COMPREPLY=($(compgen -W "$keys" -- "$cur"))
            [[ ${#COMPREPLY[@]} -eq 1 ]] && compopt -o nospace 2>/dev/null
        else
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
        return 0
    fi

    if [[ " ${valued[*]} " == *" $prev "* ]]; then
        case $prev in
            --nproc-per-node) COMPREPLY=($(compgen -W "cpu gpu auto 1 2 4 8" -- "$cur")) ;;
            --rdzv-backend) COMPREPLY=($(compgen -W "c10d static" -- "$cur")) ;;
            --start-method) COMPREPLY=($(compgen -W "spawn fork forkserver" -- "$cur")) ;;
            --log-level) COMPREPLY=($(compgen -W "debug info warn error" -- "$cur")) ;;
            --signals-to-handle)
                COMPREPLY=($(compgen -W "SIGTERM SIGINT SIGHUP SIGQUIT SIGUSR1 SIGUSR2" -- "$cur")) ;;
            --log-dir) COMPREPLY=($(compgen -d -- "$cur")) ;;
            *file* | -o | --output | --csv) COMPREPLY=($(compgen -f -- "$cur")) ;;
        esac
        return 0
    fi

    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "${flags[*]}" -- "$cur"))
        return 0
    fi
    if [[ -z $sub && $COMP_CWORD -eq 1 ]]; then
        COMPREPLY=($(compgen -W "store store-client status plot" -- "$cur"))
    fi
    case $sub in
        store | status) return 0 ;;
        store-client)
            local ops="set get add compare-set append check wait num-keys delete multi-get
                       multi-set ping queue-push queue-pop queue-len"
            COMPREPLY+=($(compgen -W "$ops" -- "$cur"))
            return 0 ;;
        plot) _ddprun_files "$cur" jsonl; return 0 ;; # metrics files
    esac
    _ddprun_files "$cur" conf py # the program: a train.conf or a Python script
    return 0
}

# _ddprun_files CUR EXT...: adds the files ending in .EXT and the directories that start with CUR
_ddprun_files() {
    local cur=$1 f ext IFS=$'\n'
    shift
    for f in $(compgen -f -- "$cur"); do
        if [[ -d $f ]]; then COMPREPLY+=("$f"); continue; fi
        for ext in "$@"; do [[ $f == *."$ext" ]] && COMPREPLY+=("$f"); done
    done
    compopt -o filenames 2>/dev/null
}
complete -F _ddprun ddprun
