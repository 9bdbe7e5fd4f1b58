dp_add_test(test_ps SOURCES test_ps.cpp LIBS dp_engine)
