# cli.help: every program's --help shows the default of each option it takes ("--steps INT=30"),
# as CLI11's always_capture_default gives it (issue 52): a program that forgets it fails here.
foreach(program dp_bench train_mnist train_text bench_kernels bench_collectives communication
        compare_my_model bench_composed custom_reducer)
  if(TARGET ${program})
    add_test(NAME "cli.help: ${program} --help shows its options' defaults"
             COMMAND $<TARGET_FILE:${program}> --help)
    set_tests_properties("cli.help: ${program} --help shows its options' defaults" PROPERTIES
      TIMEOUT 30 PASS_REGULAR_EXPRESSION "--[a-z-]+ [A-Z]+[^\n=]*=[^ \n]+")
    # cli.exit: every program exits 0 for --help and 2 for a command line that does not parse,
    # naming the flag (CLI11's own codes were 105-114, one per kind of parse error).
    add_test(NAME "cli.exit: ${program} exits 0 for --help, 2 for a flag it does not know"
             COMMAND sh -c [=["$0" --help > /dev/null; echo "help exit $?"; "$0" --no-such-flag-xyz; echo "bad flag exit $?"]=]
                     $<TARGET_FILE:${program}>)
    set_tests_properties("cli.exit: ${program} exits 0 for --help, 2 for a flag it does not know"
      PROPERTIES TIMEOUT 30
      PASS_REGULAR_EXPRESSION "help exit 0\n.*--no-such-flag-xyz.*bad flag exit 2\n")
  endif()
endforeach()
