dp_add_test(test_data SOURCES test_data.cpp LIBS dp_data)
