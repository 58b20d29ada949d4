import unittest

from todo import TodoList


class TodoListTest(unittest.TestCase):
    def test_from_items(self):
        todo = TodoList.from_items("work", [" send report ", "book room"])
        self.assertEqual(todo.items, ["send report", "book room"])
        self.assertEqual(len(todo), 2)

    def test_add_and_done(self):
        todo = TodoList.from_items("home", ["water plants"])
        todo.add("buy milk")
        todo.done("water plants")
        self.assertEqual(todo.items, ["buy milk"])

    def test_rejects_blank_and_duplicate_items(self):
        todo = TodoList.from_items("home", ["buy milk"])
        with self.assertRaises(ValueError):
            todo.add("   ")
        with self.assertRaises(ValueError):
            todo.add("buy milk")

    def test_done_unknown_item_raises(self):
        with self.assertRaises(KeyError):
            TodoList.from_items("home", []).done("fly")

    def test_new_lists_start_empty(self):
        home = TodoList("home")
        home.add("buy milk")
        work = TodoList("work")
        self.assertEqual(len(work), 0)
        self.assertEqual(home.items, ["buy milk"])


if __name__ == "__main__":
    unittest.main()
