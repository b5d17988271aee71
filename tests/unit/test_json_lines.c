/* Unit tests of common/json_lines: every line is valid JSON, whatever the numbers and strings. */
#include <criterion/criterion.h>
#include <math.h>
#include <regex.h>
#include <stdlib.h>
#include <string.h>

#include "json_lines.h"

static char *line_of(cJSON *o) {
    char *text = json_line_text(o);
    cJSON_Delete(o);
    cr_assert_not_null(text);
    return text;
}

Test(json_lines, non_finite_numbers_are_null) {
    cJSON *o = json_line_new("train");
    json_line_num(o, "nan", NAN);
    json_line_num(o, "inf", INFINITY);
    json_line_num(o, "minus_inf", -INFINITY);
    json_line_num(o, "loss", 0.25);
    json_line_int(o, "step", 9007199254740992LL);
    char *text = line_of(o);
    cr_assert(strstr(text, "\"nan\":null,\"inf\":null,\"minus_inf\":null,\"loss\":0.25"), "%s",
              text);
    cr_assert(strstr(text, "\"step\":9007199254740992"), "%s", text);
    cr_assert_null(strstr(text, "nan,"), "%s", text);
    cJSON *back = cJSON_Parse(text);
    cr_assert_not_null(back, "not JSON: %s", text);
    cJSON_Delete(back);
    cJSON_free(text);
}

Test(json_lines, strings_are_escaped) {
    cJSON *o = json_line_new("eval");
    json_line_str(o, "path", "a\"b\\c\nd\x01");
    char *text = line_of(o);
    cr_assert_null(strchr(text, '\n'), "one line: %s", text);
    cJSON *back = cJSON_Parse(text);
    cr_assert_not_null(back);
    cr_assert_str_eq(cJSON_GetObjectItem(back, "path")->valuestring, "a\"b\\c\nd\x01");
    cJSON_Delete(back);
    cJSON_free(text);
}

Test(json_lines, event_and_utc_time_come_first) {
    char *text = line_of(json_line_new("final"));
    regex_t re;
    cr_assert_eq(regcomp(&re,
                         "^\\{\"event\":\"final\",\"time\":\"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:"
                         "[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z\"\\}$",
                         REG_EXTENDED),
                 0);
    cr_assert_eq(regexec(&re, text, 0, NULL, 0), 0, "%s", text);
    regfree(&re);
    cJSON_free(text);
}

Test(json_lines, write_appends_one_line_and_frees) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cJSON *o = json_line_new("snapshot");
    json_line_int(o, "step", 4);
    cr_assert_eq(json_line_write(f, o), 0);
    cr_assert_eq(json_line_write(f, json_line_new("x")), 0);
    fclose(f);
    cr_assert_eq(strchr(buf, '\n') - buf + 1 < (long)len, 1);
    cr_assert_eq(buf[len - 1], '\n');
    free(buf);
}
