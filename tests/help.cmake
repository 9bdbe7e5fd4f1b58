# cli.help: every program's --help shows the default of each option it takes ("--steps INT=30"),
# as CLI11's always_capture_default gives it (issue 52): a program that forgets it fails here.
foreach(program dp_bench train_mnist train_text bench_kernels bench_collectives communication
        compare_my_model bench_composed custom_reducer)
  if(TARGET ${program})
    add_test(NAME "cli.help: ${program} --help shows its options' defaults"
             COMMAND $<TARGET_FILE:${program}> --help)
    set_tests_properties("cli.help: ${program} --help shows its options' defaults" PROPERTIES
      TIMEOUT 30 PASS_REGULAR_EXPRESSION "--[a-z-]+ [A-Z]+[^\n=]*=[^ \n]+")
  endif()
endforeach()
