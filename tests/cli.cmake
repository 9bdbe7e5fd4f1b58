# bench.progress: the programs' progress line and --log step log (dp/cli/progress.*); cli.outputs:
# their output files (dp/cli/cli.hpp, nn/file_io.hpp).
if(TARGET dp_cli)
  dp_add_test(test_cli SOURCES test_cli_progress.cpp test_cli_outputs.cpp LIBS dp_cli dp_engine)
endif()
