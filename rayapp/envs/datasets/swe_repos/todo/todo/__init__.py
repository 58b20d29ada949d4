from todo.lists import TodoList

__all__ = ["TodoList"]
