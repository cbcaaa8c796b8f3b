// The atlas page's table (book/atlas.ipynb, normtools.cards.atlas.html): a filter above each
// column marked data-filter (a choice of the column's values), a search on the family name,
// sorting by a click on a column's header (numbers by value), and a count of the rows shown.
// Plain DOM, no library: the page works offline from the built HTML.
(function () {
  "use strict";

  function cellValue(row, index) {
    var cell = row.cells[index];
    return cell ? (cell.getAttribute("data-value") || cell.textContent.trim()) : "";
  }

  function setUp(table) {
    var head = table.tHead.rows[0];
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var columns = Array.prototype.slice.call(head.cells);
    var filters = {};
    var controls = document.createElement("div");
    controls.className = "atlas-controls";
    var count = document.createElement("p");
    count.className = "atlas-count";

    function apply() {
      var shown = 0;
      rows.forEach(function (row) {
        var keep = Object.keys(filters).every(function (index) {
          var f = filters[index];
          if (!f.value) { return true; }
          var v = cellValue(row, +index);
          return f.search ? v.toLowerCase().indexOf(f.value.toLowerCase()) >= 0 : v === f.value;
        });
        row.hidden = !keep;
        shown += keep ? 1 : 0;
      });
      count.textContent = shown + " of " + rows.length + " families shown";
      table.setAttribute("data-shown", String(shown));
    }

    columns.forEach(function (th, index) {
      var kind = th.getAttribute("data-filter");
      if (!kind) { return; }
      var label = document.createElement("label");
      label.textContent = th.getAttribute("data-label") || th.textContent.trim();
      var control;
      if (kind === "search") {
        control = document.createElement("input");
        control.type = "search";
        control.placeholder = "name contains";
      } else {
        control = document.createElement("select");
        var values = {};
        // each value offered under the text its cells show (a short form, see the legend)
        rows.forEach(function (row) { values[cellValue(row, index)] = row.cells[index].textContent.trim(); });
        [""].concat(Object.keys(values).sort()).forEach(function (v) {
          var option = document.createElement("option");
          option.value = v;
          option.textContent = v === "" ? "any" : values[v];
          control.appendChild(option);
        });
      }
      control.setAttribute("data-column", th.getAttribute("data-key") || String(index));
      filters[index] = {search: kind === "search", value: ""};
      control.addEventListener("input", function () { filters[index].value = control.value; apply(); });
      control.addEventListener("change", function () { filters[index].value = control.value; apply(); });
      label.appendChild(control);
      controls.appendChild(label);
    });

    columns.forEach(function (th, index) {
      th.classList.add("atlas-sortable");
      th.setAttribute("title", "sort by this column");
      th.addEventListener("click", function () {
        var ascending = th.getAttribute("aria-sort") !== "ascending";
        columns.forEach(function (other) { other.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        var numeric = th.getAttribute("data-sort") === "number";
        rows.sort(function (a, b) {
          var x = cellValue(a, index), y = cellValue(b, index);
          var order = numeric ? (parseFloat(x) || 0) - (parseFloat(y) || 0) : x.localeCompare(y);
          return ascending ? order : -order;
        });
        rows.forEach(function (row) { body.appendChild(row); });
      });
    });

    table.parentNode.insertBefore(controls, table);
    table.parentNode.insertBefore(count, table);
    apply();
  }

  function init() {
    Array.prototype.forEach.call(document.querySelectorAll("table.atlas-table"), setUp);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
