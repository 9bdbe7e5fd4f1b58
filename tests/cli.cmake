# bench.progress: the programs' progress line and --log step log (dp/cli/progress.*).
if(TARGET dp_cli)
  dp_add_test(test_cli SOURCES test_cli_progress.cpp LIBS dp_cli)
endif()
